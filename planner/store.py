"""The profile store: a directory with one JSON file per device fingerprint, entries keyed by op signature.

Identical layers (in one model or across models) share one entry, so a second `planner profile` measures only
what is new. Writers take an fcntl lock on a sidecar lock file, re-read the file, merge their entries and replace
it atomically, so concurrent runs lose nothing and readers never see half a file. Estimated (analytic) entries
live in their own file (`*.estimated.json`) and never mix with measured ones.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from planner.files import FORMAT_VERSION, PlannerError, atomic_write_text
from planner.fuse import (bn_relu_candidates, bn_relu_nodes, concat_view_nodes, relu_sum_candidates,
                          relu_sum_nodes, with_bn_relu, with_relu_sums)
from planner.ir import Graph, Node, recompute_nodes
from planner.ops import KINDS
from planner.profile import TIMING, Candidate, DeviceInfo, OpProfile, Profile, describe_op

FLUSH_EVERY_OPS = 16
FLUSH_EVERY_S = 5.0


class StoreFile(BaseModel):
    """One device's entries on disk."""

    kind: Literal["profile_store"] = "profile_store"
    format_version: int = FORMAT_VERSION
    fingerprint: str
    estimated: bool
    device: DeviceInfo
    ops: dict[str, OpProfile] = Field(default_factory=dict, description="keyed by op signature")


def require_same_device(device: DeviceInfo, expected: DeviceInfo, what: str = "profile") -> None:
    """Refuse measurements from another GPU model or software stack (never use them silently)."""
    if device.fingerprint != expected.fingerprint:
        raise PlannerError(
            f"this {what} was made for device {device.fingerprint!r} (cuDNN {device.cudnn_version or 'none: analytic'}), "
            f"not for {expected.fingerprint!r} (cuDNN {expected.cudnn_version or 'none: analytic'}); "
            "profile this device instead"
        )


def view_profile(node: Node, graph: Graph) -> OpProfile:
    """Views launch nothing: one free candidate, never measured."""
    return OpProfile(signature=node.signature, kind=node.kind, describe=describe_op(node, graph),
                     candidates=[Candidate(name="view", time_us=0.0, sm_fraction=0.0)])


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


class ProfileStore:
    """Entries of one device (and one kind: measured or estimated) in `directory`."""

    def __init__(self, directory: str | os.PathLike, device: DeviceInfo, estimated: bool = False):
        self.directory = Path(directory)
        self.device = device
        self.estimated = estimated
        stem = _safe_name(device.fingerprint) + (".estimated" if estimated else "")
        self.path = self.directory / f"{stem}.json"
        self.lock_path = self.directory / f".{stem}.lock"

    def _load(self) -> StoreFile:
        """The file as it is now (an empty store if absent), refusing another device's or kind's file."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return StoreFile(fingerprint=self.device.fingerprint, estimated=self.estimated, device=self.device)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlannerError(f"{self.path}: not a readable profile store file ({e})") from None
        if not isinstance(raw, dict) or raw.get("kind") != "profile_store":
            raise PlannerError(f"{self.path}: not a profile store file")
        if raw.get("format_version") != FORMAT_VERSION:
            raise PlannerError(f"{self.path}: profile store format version {raw.get('format_version')} is not supported "
                               f"(this planner reads version {FORMAT_VERSION})")
        try:
            stored = StoreFile.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise PlannerError(f"{self.path}: invalid profile store file: {where}: {first['msg']}") from None
        require_same_device(stored.device, self.device, what=f"profile store {self.path}")
        if stored.estimated != self.estimated:
            raise PlannerError(f"{self.path}: holds {'estimated' if stored.estimated else 'measured'} entries, "
                               f"expected {'estimated' if self.estimated else 'measured'} ones")
        return stored

    @contextmanager
    def _locked(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def entries(self) -> dict[str, OpProfile]:
        return self._load().ops

    def get(self, signature: str) -> OpProfile | None:
        return self._load().ops.get(signature)

    def put(self, op_profile: OpProfile) -> None:
        self.put_many([op_profile])

    def put_many(self, op_profiles: Iterable[OpProfile]) -> None:
        """Merge entries into the file under the lock; a later put for the same signature replaces the earlier."""
        new = list(op_profiles)
        if new:
            self._rewrite(lambda stored: stored.ops.update((op.signature, op) for op in new))

    def set_calibration(self, mode: str, dispatch_us: float | None, copy_slowdown: dict[str, float],
                        copy_interference: float | None, one_stream_dispatch_us: float | None = None,
                        co_running: float | None = None) -> None:
        """Record the device's calibrated per-op dispatch times in one mode, copy slowdown and copy interference
        (`planner calibrate`; DeviceInfo.calibrate)."""
        self._rewrite(lambda stored: stored.device.calibrate(mode, dispatch_us, copy_slowdown, copy_interference,
                                                             one_stream_dispatch_us, co_running))

    def _rewrite(self, change: Callable[[StoreFile], None]) -> None:
        """Re-read the file under the lock, apply `change`, replace it atomically."""
        with self._locked():
            stored = self._load()
            change(stored)
            atomic_write_text(self.path, stored.model_dump_json(indent=1) + "\n")

    def import_profile(self, profile: Profile) -> int:
        """Add a profile file's entries (same device and kind only); returns how many."""
        require_same_device(profile.device, self.device)
        if profile.estimated != self.estimated:
            raise PlannerError("cannot mix estimated and measured entries in one store")
        self.put_many(profile.ops.values())
        return len(profile.ops)

    def missing(self, graph: Graph, offered: Callable[[Node], list[str]] | None = None) -> list[str]:
        """Signatures of the graph's ops not stored yet (views need no measurement), in graph order. In a measured
        store, an entry that fell back to an estimate counts as missing (a newer runner may measure it), and so
        does one timed the older way (`OpProfile.timing`): a profile's ops are all timed alike. `offered(node)`:
        the implementations the runner has for a node; an entry measured without one of them is missing too."""
        stored = self.entries()
        out: dict[str, None] = {}
        for n in profiled_nodes(graph):
            entry = stored.get(n.signature)
            if not KINDS[n.kind].view and (entry is None or (not self.estimated and (
                    entry.estimated or entry.timing != TIMING
                    or (offered is not None and not set(offered(n)) <= set(entry.implementations))))):
                out.setdefault(n.signature)
        return list(out)

    def assemble(self, graph: Graph) -> Profile:
        """The profile of one graph from the stored entries; every non-view op must be stored, all timed alike."""
        stored = self._load()
        ops: dict[str, OpProfile] = {}
        absent: list[str] = []
        for n in graph.nodes:
            if KINDS[n.kind].view:
                ops.setdefault(n.signature, view_profile(n, graph))
            elif n.signature in stored.ops:
                ops[n.signature] = stored.ops[n.signature]
            else:
                absent.append(n.name)
        for n in optional_nodes(graph):  # without them a recomputation is priced as its chain, no concat is a view
            if n.signature in stored.ops:
                ops[n.signature] = stored.ops[n.signature]
        if absent:
            raise PlannerError(f"{len(absent)} ops of {graph.model_name} are not in the profile store {self.path} "
                               f"(first: {absent[0]}); run `planner profile` for this model first")
        timed = [op.timing for op in ops.values() if not op.estimated and not KINDS[op.kind].view]
        if len(set(timed)) > 1:
            older = sum(t != TIMING for t in timed)
            raise PlannerError(f"{older} ops of {graph.model_name} in the profile store {self.path} were timed "
                               f"the older way (OpProfile.timing), the others not; run `planner profile` for this "
                               f"model to time them alike")
        return Profile(estimated=self.estimated, device=stored.device, dtype=graph.dtype,
                       graph_sha256=graph.graph_sha256, ops=ops)


RECOMPUTATIONS, VIEWS, BN_RELU, RELU_SUMS = ("recomputations", "ops writing into a concat's channels",
                                            "BatchNormalizations with their ReLUs", "ReLU backwards adding up gradients")


def optional_groups(graph: Graph) -> dict[str, list[Node]]:
    """`optional_nodes` by what they are (RECOMPUTATIONS, VIEWS, BN_RELU, RELU_SUMS)."""
    groups: dict[str, list[Node]] = {}
    for group, n in _optional(graph):
        groups.setdefault(group, []).append(n)
    return groups


def optional_nodes(graph: Graph) -> list[Node]:
    """Nodes the graph does not run as they stand but a plan may: its fused recomputations (ir.recompute_nodes),
    its convs writing into a concat's channel slices (fuse.concat_view_nodes), its BatchNormalizations running
    their ReLUs (fuse.bn_relu_nodes), writing into a concat's channel slices too where they can, and its ReLU
    backwards adding up their gradients (fuse.relu_sum_nodes), with BatchNormalizations fused or not."""
    return [n for _, n in _optional(graph)]


def _optional(graph: Graph) -> list[tuple[str, Node]]:
    """(group, node) of `optional_nodes`, one per signature, in the order they are found."""
    fused = with_bn_relu(graph, bn_relu_candidates(graph))
    found = [(RECOMPUTATIONS, recompute_nodes(graph).values()), (VIEWS, concat_view_nodes(graph))]
    if fused is not graph:
        found += [(BN_RELU, bn_relu_nodes(fused)), (RECOMPUTATIONS, recompute_nodes(fused).values()),
                  (VIEWS, concat_view_nodes(fused))]
    found += [(RELU_SUMS, relu_sum_nodes(with_relu_sums(g, relu_sum_candidates(g)))) for g in (graph, fused)]
    out: dict[str, tuple[str, Node]] = {}
    for group, nodes in found:
        for n in nodes:
            out.setdefault(n.signature, (group, n))
    return list(out.values())


def profiled_nodes(graph: Graph) -> list[Node]:
    """What a profile measures: the graph's nodes and its optional ones."""
    return graph.nodes + optional_nodes(graph)


@dataclass
class Behind:
    """What a measured profile lacks that the runner offers its graph now; `planner profile` measures it."""

    unmeasured: dict[str, int]  # group (optional_groups) -> the graph's optional ops the profile never measured
    without: dict[str, int]  # implementation -> ops measured before the runner offered it
    older_timing: int  # ops timed the older way (OpProfile.timing)

    def __bool__(self) -> bool:
        return bool(self.unmeasured or self.without or self.older_timing)

    def describe(self) -> str:
        parts = []
        if self.unmeasured:
            parts.append(f"{sum(self.unmeasured.values())} fused ops never measured ("
                         + ", ".join(f"{k} {group}" for group, k in self.unmeasured.items()) + ")")
        if self.without:
            parts.append("ops measured before the runner offered " + ", ".join(
                f"{impl} ({k})" for impl, k in self.without.items()))
        if self.older_timing:
            parts.append(f"{self.older_timing} ops timed the older way")
        return "; ".join(parts)


def behind(graph: Graph, profile: Profile, offered: Callable[[Node], list[str]] | None = None) -> Behind:
    """What `profile` lacks for `graph` (nothing for an estimated one): a plan cannot use a fused op or an
    implementation that was never measured, so a profile made before the runner offered them plans without them
    (`offered(node)`: the implementations the runner has for a node, as in ProfileStore.missing)."""
    if profile.estimated:
        return Behind({}, {}, 0)
    groups = optional_groups(graph)
    unmeasured = {group: sum(n.signature not in profile.ops for n in nodes) for group, nodes in groups.items()}
    without: dict[str, int] = {}
    for n in {n.signature: n for n in graph.nodes + [n for nodes in groups.values() for n in nodes]}.values():
        entry = profile.ops.get(n.signature)
        if entry is not None and offered is not None and not KINDS[n.kind].view:
            for impl in offered(n):
                if impl not in entry.implementations:
                    without[impl] = without.get(impl, 0) + 1
    older = sum(op.timing != TIMING for op in profile.ops.values() if not op.estimated and not KINDS[op.kind].view)
    return Behind({group: k for group, k in unmeasured.items() if k}, without, older)


def profile_graph(graph: Graph, store: ProfileStore, measure: Callable[[list[Node]], Iterable[OpProfile]],
                  force: bool = False, offered: Callable[[Node], list[str]] | None = None) -> tuple[Profile, int]:
    """Measure (or estimate) what the store lacks (ProfileStore.missing), or every op with force, and assemble the
    graph's profile.

    `measure` gets one node per signature to do and yields OpProfiles; they are saved in batches while it runs,
    so an interrupted run keeps what it finished. Returns the profile and how many ops were measured now.
    """
    nodes = profiled_nodes(graph)
    if force:
        todo = list(dict.fromkeys(n.signature for n in nodes if not KINDS[n.kind].view))
    else:
        todo = store.missing(graph, offered)
    first = {}
    for n in nodes:
        first.setdefault(n.signature, n)
    done, pending, last_flush = 0, [], time.monotonic()
    try:
        for op in measure([first[s] for s in todo]):
            pending.append(op)
            done += 1
            if len(pending) >= FLUSH_EVERY_OPS or time.monotonic() - last_flush >= FLUSH_EVERY_S:
                store.put_many(pending)
                pending, last_flush = [], time.monotonic()
    finally:
        store.put_many(pending)
    return store.assemble(graph), done


def measured_stores(directory: str | os.PathLike) -> list[tuple[Path, DeviceInfo]]:
    """Each measured store file in `directory` (in name order) with the device it was made on."""
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        if path.name.endswith(".estimated.json"):
            continue
        try:
            device = DeviceInfo.model_validate(json.loads(path.read_text())["device"])
        except (OSError, ValueError, KeyError, ValidationError):
            continue
        if ProfileStore(directory, device).path == path:
            out.append((path, device))
    return out


def measured_profiles_for(graph: Graph, directory: str | os.PathLike) -> list[Profile]:
    """The graph's profile from each measured store file in `directory` that holds every op, in name order
    (without a GPU there is no fingerprint to ask for, so the caller picks among the devices)."""
    out = []
    for _, device in measured_stores(directory):
        try:
            out.append(ProfileStore(directory, device).assemble(graph))
        except PlannerError:
            continue
    return out
