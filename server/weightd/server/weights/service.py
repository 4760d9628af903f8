"""The weights service: the one object both edges call to serve a model's weights.

A gRPC ``Fetch`` (``rpc/weights.py``) and a same-host fetch (``transports/
local_service.py``) each used to resolve the model at a version, plan the layout and
mark a model broken themselves, with different rules for a version: the gRPC edge
refused one when the daemon serves no versions, the side socket ignored it. Here is
the one rule, :meth:`WeightService.model`, for both wires.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..base.errors import InvalidRequest
from ..plan.layout import Layout, LayoutFields
from ..plan.planner import RankPlan
from ..registry.identity import host_boot_id, shard_samples
from ..registry.models import LoadedModel, ModelRegistry
from ..registry.versions import ModelVersions
from ..store.residency import drop_cached
from .view import RankView


@dataclass(frozen=True, slots=True)
class ModelListing:
    """One name the daemon knows, whether or not a version of it is ready."""

    name: str
    state: str
    reason: str
    ready: bool
    #: Its current version; None while it is loading or failed.
    model: LoadedModel | None


@dataclass(frozen=True, slots=True)
class HeldFile:
    """A checkpoint file the load read and verified, as the daemon holds it.

    ``sha256`` is "" where the daemon did not hash the whole file; the file identity
    and ``sample_digest`` are set for shards only (``registry/identity.py``).
    """

    name: str
    size: int
    sha256: str
    shard: bool
    device: int = 0
    inode: int = 0
    mtime_ns: int = 0
    sample_digest: str = ""


class WeightService:
    """Model at version, plan, rank view, marking broken: what both edges share."""

    def __init__(self, registry: ModelRegistry, versions: ModelVersions | None = None) -> None:
        self.registry = registry
        #: Every version still held (None: only the current version of each model).
        self.versions = versions

    def model(self, name: str, version: int) -> LoadedModel:
        """``name`` (empty: the only model) at ``version`` (0: the current one).

        The one rule on every wire: a daemon without versions serves version 0 only and
        refuses any other; one with versions serves each version still held.
        """
        if self.versions is None:
            if version:
                raise InvalidRequest(
                    f"this daemon serves no model versions; ask for version 0, not {version}"
                )
            return self.registry.get(name)
        return self.versions.resolve(name, version)

    def plan(self, model: LoadedModel, layout: LayoutFields, names: Sequence[str] = ()) -> RankPlan:
        """``model``'s plan for the layout a request names, cut to ``names`` when given.

        The layout is validated and planned by the same code for every wire, so a
        pipeline stage or an expert rank gets the same slices whichever way it fetches.
        """
        return model.plan_layout(Layout.of(layout), tuple(names))

    def rank_view(
        self, name: str, version: int, layout: LayoutFields, names: Sequence[str] = ()
    ) -> RankView:
        """What one rank reads of ``name`` at ``version``: the model and its plan."""
        model = self.model(name, version)
        return RankView(model, self.plan(model, layout, names))

    def mark_broken(self, model: LoadedModel, error: BaseException) -> None:
        """``model``'s bytes were found changed: it serves nothing until reloaded."""
        self.registry.mark_broken(model, str(error))

    def listing(self) -> list[ModelListing]:
        """Every model name the daemon knows, sorted, with its state."""
        loaded = {m.name: m for m in self.registry.models()}
        out = []
        for name in self.registry.names():
            state, reason = self.registry.state(name)
            ready = name in loaded and self.registry.is_ready(name)
            out.append(ModelListing(name, state, reason, ready, loaded.get(name)))
        return out

    @staticmethod
    def held_files(model: LoadedModel) -> list[HeldFile]:
        """Every file ``model``'s load read and verified, sorted by name.

        So a client can prove a local copy (vLLM's model directory) is this checkpoint:
        a file's SHA-256 where the daemon hashed the whole file (manifest, HF cache), its
        size always, and for each shard the identity of the file the daemon holds and a
        sampled digest of its tensors (a fine-tune of the same shapes is told apart
        without reading the whole checkpoint).
        """
        ckpt = model.checkpoint
        samples = shard_samples(model)
        out = []
        for name in sorted(set(ckpt.small_files) | set(ckpt.shards)):
            known = model.file_digests.get(name)
            sha256 = known.sha256 if known is not None else ""
            if name not in ckpt.shards:
                size = known.size if known is not None else model.store.shard(name).identity.size
                out.append(HeldFile(name, size, sha256, shard=False))
                continue
            held = model.store.shard(name).identity
            size = known.size if known is not None else held.size
            out.append(
                HeldFile(name, size, sha256, True, held.dev, held.ino, held.mtime_ns, samples[name])
            )
        return out

    @staticmethod
    def boot_id() -> str:
        """This host's boot id: a shard's (device, inode) means something on it only."""
        return host_boot_id()

    @staticmethod
    def drop_shard_pages(model: LoadedModel) -> None:
        """Drop ``model``'s shard pages from the page cache (its packs are the copy now)."""
        for shard in model.store.shards.values():
            drop_cached(shard.fd)
