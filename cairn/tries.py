"""One try of a step, from plan to outcome: the lifecycle every integration shares.

An integration translates its orchestrator's identity and lifecycle into these calls and
nothing else::

    t = Try.begin(store=url, key=key, policy=ResumePolicy(...))  # reads the history once
    t.check()                       # raises GaveUp when the policy says stop (a crash loop)
    os.environ.update(t.env())      # CAIRN_STORE, CAIRN_KEY, CAIRN_EXCLUDE_SEQS for subprocesses
    ckpt = t.checkpointer(every_steps=100)        # state mode, or t.run_argv(...) for process
    ...
    verdict = t.ended(error=error, ckpt=ckpt)     # records the outcome once; retry/stop/resched.
    t.finish(ckpt)                                # success: the key is marked done

The plan honours the resume policy (:mod:`cairn.policy.resume`): snapshots it excludes are
never restored, by the Checkpointer (``exclude_seqs``) or by ``cairn run``
(``--exclude-seqs``). A try's outcome is recorded once per epoch (state mode; ``cairn run``
records its own). Imports neither torch nor an orchestrator until asked for a Checkpointer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cairn.exceptions import GaveUp, NotFound
from cairn.policy.history import History
from cairn.policy.resume import AfterTry, ResumePlan, ResumePolicy, after_try, plan_resume
from cairn.runtime import endings, env
from cairn.runtime.session import conclude, end_of_error
from cairn.store import Key, url_forms

log = logging.getLogger(__name__)


def read_history(store: str, key: Key) -> History:
    """``key``'s tries and outcome records in the store at ``store``; empty when the store does
    not exist yet (the first try creates it). The store's credentials must be in the
    environment."""
    from cairn.runtime.stores import open_store

    try:
        with open_store(store, create=False) as opened:
            return History.from_store(opened, key)
    except NotFound:
        log.info("cairn: no store at %s yet: no history", store)
        return History()


def run_argv(executable: Sequence[str], command: Sequence[str], *, store: str, key: Key | str,
             every: str, grace: str, exclude: Iterable[int] = (), workdir: str | None = None,
             keep: bool = False) -> list[str]:
    """``cairn run``'s command line: ``executable`` (how to start the CLI) ``run`` with the
    store, the key, the interval and grace (duration texts), the snapshots never to restore,
    the work directory and ``--keep``, then ``--`` and ``command``."""
    argv = [*executable, "run", "--store", store, "--key", str(key), "--every", every,
            "--grace", grace]
    exclude = frozenset(exclude)
    if exclude:
        argv += ["--exclude-seqs", env.format_seqs(exclude)]
    if workdir:
        argv += ["--workdir", workdir]
    if keep:
        argv.append("--keep")
    return [*argv, "--", *map(str, command)]


class Try:
    """One try of ``key``'s work in ``store``, planned from the key's history. Not shared
    between threads; the integration's thread makes every call."""

    def __init__(self, *, store: str, key: Key, policy: ResumePolicy, history: History,
                 started_at: float | None = None) -> None:
        self.store = store
        self.key = key
        self.policy = policy
        self.history = history
        self.plan: ResumePlan = plan_resume(history, policy)
        self.started_at = time.time() if started_at is None else started_at
        self._recorded: set[int] = set()

    @classmethod
    def begin(cls, *, store: str, key: Key | str, policy: ResumePolicy | None = None,
              try_number: int | None = None) -> Try:
        """Read ``key``'s history and plan this try (logged in one line). A store that cannot
        be reached raises :class:`~cairn.exceptions.StoreUnreachable`, never an empty plan.

        ``try_number``: the orchestrator's count of this try (1 for the first), when it has
        one. A later try that finds no try at all in the store is warned about: a store that
        a worker sees empty or missing (a volume not mounted here, a local directory on
        another node) cannot be told from a new one, so that try starts from step 0."""
        parsed = key if isinstance(key, Key) else Key.parse(key)
        t = cls(store=store, key=parsed, policy=policy or ResumePolicy(),
                history=read_history(store, parsed))
        if try_number is not None and try_number > 1 and not t.history.tries:
            log.warning("cairn: this is try %d of %s, but the store %s holds no try of it: if "
                        "an earlier try committed snapshots, this worker does not see that "
                        "store (a volume not mounted here, a local directory on another node: "
                        "use a store every worker shares: %s); starting from step 0",
                        try_number, parsed, store, url_forms(remote=True))
        log.info("cairn: resume plan for %s: %s", parsed, t.plan.reason)
        return t

    def unnumbered_note(self) -> str | None:
        """For an orchestrator that gives a step no try number (KFP: no placeholder holds it,
        and the task id changes on every retry): when the store holds no try of the key, the
        line that says this may be a retry that does not see the store its earlier tries used
        (print it once per try); None when the store knows an earlier try."""
        if self.history.tries:
            return None
        return (f"cairn: the store {self.store} holds no try of {self.key}: a first try, or a "
                "retry that does not see the store its earlier tries used (a volume not mounted "
                "here, a local directory on another node), which this orchestrator gives no try "
                f"number to tell apart; starting from step 0. Use a store every try sees: "
                f"{url_forms(remote=True)}")

    @property
    def exclude(self) -> frozenset[int]:
        """The snapshots this try must not restore."""
        return self.plan.exclude

    @property
    def reason(self) -> str:
        """The plan's one-line reason."""
        return self.plan.reason

    def check(self) -> None:
        """Raise :class:`GaveUp` when the policy says the step must not run again."""
        if self.plan.give_up:
            raise GaveUp(f"cairn: {self.plan.reason}. Fix the step, then clear or rerun it (or "
                         "raise max_error_retries)")

    def env(self, *, every_steps: int | None = None,
            every_seconds: float | None = None) -> dict[str, str]:
        """The variables a subprocess needs for ``Checkpointer.from_env()`` and ``cairn run``."""
        values = {env.STORE.name: self.store, env.KEY.name: str(self.key),
                  env.EXCLUDE_SEQS.name: env.format_seqs(self.exclude)}
        if every_steps is not None:
            values[env.EVERY_STEPS.name] = str(every_steps)
        if every_seconds is not None:
            values[env.EVERY_SECONDS.name] = str(every_seconds)
        return values

    def checkpointer(self, **options: Any) -> Any:
        """A state-mode :class:`~cairn.state.checkpointer.Checkpointer` for this try (imports
        torch), restoring nothing the plan excludes."""
        from cairn.state.checkpointer import Checkpointer

        return Checkpointer(store=self.store, key=self.key, exclude_seqs=self.exclude, **options)

    def run_argv(self, executable: Sequence[str], command: Sequence[str], *, every: str,
                 grace: str, workdir: str | None = None, keep: bool = False) -> list[str]:
        """The ``cairn run`` command line for this try (process mode)."""
        return run_argv(executable, command, store=self.store, key=self.key, every=every,
                        grace=grace, exclude=self.exclude, workdir=workdir, keep=keep)

    def ended(self, *, error: BaseException | None, ckpt: Any = None,
              detail: Mapping[str, Any] | None = None) -> AfterTry:
        """The try ended with ``error`` (None: it succeeded). Records the state-mode outcome of
        ``ckpt``'s epoch (once; best effort) and returns what the orchestrator should do:
        retry, stop (a crash loop) or reschedule (a preemption within ``max_preemptions``)."""
        epoch = getattr(ckpt, "epoch", None) if ckpt is not None else None
        if epoch is not None and epoch not in self._recorded:
            self._recorded.add(epoch)
            endings.record_try(ckpt, self.store, self.key, started_at=self.started_at,
                               error=error, detail=dict(detail or {}))
        if error is None:
            return AfterTry.RETRY  # nothing to retry; the value is never acted on
        return after_try(self.plan, self.policy, conclude(end_of_error(error)).outcome)

    def finish(self, ckpt: Any = None) -> None:
        """The step succeeded: mark the key done (durable when this returns)."""
        endings.mark_done(ckpt, self.store, self.key)
