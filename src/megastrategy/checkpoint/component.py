"""Checkpoints and exact resume as a component.

Saving and loading are Lightning strategy calls; this component answers them with what the job
looks like now (layout, plan, stage, random streams), and puts the random streams and the
loader position back at the right moment of a restart (see :mod:`.resume`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from megastrategy.checkpoint.async_writer import AsyncCheckpointWriter
from megastrategy.checkpoint.dcp_io import PathLike
from megastrategy.checkpoint.lightning import CheckpointSite, load_lightning_checkpoint, save_lightning_checkpoint
from megastrategy.checkpoint.resume import ExactResume
from megastrategy.checkpoint.save_pretrained_guard import refuse_partial_save_pretrained, sharding_of
from megastrategy.component import Component, Environment, SetupContext
from megastrategy.config import MegatronConfig


class Checkpoints(Component):
    """Sharded DCP checkpoints that reshard on load, and resume at the next unseen sample on any layout."""

    def __init__(self, config: Optional[MegatronConfig] = None) -> None:
        self.exact_resume = ExactResume()
        self.writer = AsyncCheckpointWriter() if config is not None and config.async_checkpoint else None
        self._env: Optional[Environment] = None
        self._ctx: Optional[SetupContext] = None

    def on_environment(self, env: Environment) -> None:
        self._env = env
        ps = env.parallel_state
        self.exact_resume.set_position(dp_rank=ps.dp_rank, dp_size=ps.dp_size,
                                       data_source=env.global_rank == ps.replica_ranks[0])

    def configure(self, ctx: SetupContext) -> None:
        self._ctx = ctx

    def apply(self, module: Any, ctx: SetupContext) -> None:
        refuse_partial_save_pretrained(module, sharding_of(ctx.parallel_state))

    def on_train_loader(self, loader: Any, trainer: Any) -> Any:
        """The training loader resumes mid-epoch at the next unseen batch."""
        return self.exact_resume.wrap_train_loader(loader, trainer)

    def on_train_start(self) -> None:
        # After the restart's own work (loaders, sanity check), before what the saved run did next.
        self.exact_resume.restore_random_states(self._ctx.rng_tracker if self._ctx is not None else None)

    # ------------------------------------------------------------------ called by the strategy
    def save(self, module: Any, optimizers: Callable[[], list], checkpoint: dict, filepath: PathLike,
             barrier: Callable[[], None]) -> None:
        save_lightning_checkpoint(self._site(module, optimizers, barrier), checkpoint, filepath)

    def wait_for_writes(self) -> None:
        """Return when the save in flight (``async_checkpoint=True``) is on disk under its final name."""
        if self.writer is not None:
            self.writer.wait()

    def load(self, module: Any, optimizers: Callable[[], list], path: PathLike) -> dict:
        self.wait_for_writes()  # the checkpoint asked for may be the one being written
        return load_lightning_checkpoint(self._site(module, optimizers, lambda: None), path)

    def _site(self, module: Any, optimizers: Callable[[], list], barrier: Callable[[], None]) -> CheckpointSite:
        env, ctx = self._env, self._ctx
        if env is None:
            raise RuntimeError("MegatronStrategy: checkpoints need the process groups (setup_environment has not run).")
        return CheckpointSite(
            module=module, parallel_state=env.parallel_state, optimizers=optimizers,
            layout_record=layout_record(env.layout), global_rank=env.global_rank, is_coordinator=env.global_rank == 0,
            barrier=barrier, exact_resume=self.exact_resume,
            plan=ctx.plan if ctx is not None else None,
            stack_path=ctx.stage.stack_path if ctx is not None and ctx.stage is not None else None,
            rng_tracker=ctx.rng_tracker if ctx is not None else None,
            write=self.writer.submit if self.writer is not None else None,
        )

    def on_exception(self, exception: BaseException) -> None:
        # A failed run does not wait for a save in flight (its peers may be gone); the previous
        # checkpoint stays the loadable one and the daemon writer ends with the process.
        if self.writer is not None:
            self.writer.abandon()

    def teardown(self) -> None:
        if self.writer is not None:
            self.writer.close()  # the run ends when its last checkpoint is on disk


def layout_record(layout: Any) -> dict[str, Any]:
    """The sizes a checkpoint records, to tell a same-layout resume from a reshard."""
    return {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp,
            "ep": layout.ep, "etp": layout.etp, "order": layout.order}
