"""End-to-end RL baseline: GRPO on whole tasks from the first user turn (the paper's comparison).

PivotRL trains single model calls on demonstration histories. The baseline it is compared with
plays each task from scratch: the policy acts on its *own* history in the live tool environment
(the full-task runner, :func:`pivotrl.evaluation.full_task.evaluate_full_tasks`), ``group_size``
K episodes per task, and is rewarded by the full-task judge at the end.

Per step (:func:`e2e_step`):

1. K episodes of every task in the batch, all sampled from π_old (the current weights in the
   rollout engine) at ``temperature``; every model call's prompt and generated tokens are
   recorded through the runner's ``on_model_call`` hook;
2. one reward per episode: ``reward="full_task"`` 1 if every user turn passed, else 0 (the
   default; the paper's outcome reward) or ``reward="per_turn"`` the fraction of user turns
   passed (turns passed / turns; a denser named variant);
3. the group-relative advantage Â_i of episode i among the K episodes of its task, with the same
   estimator as PivotRL (``pivotrl.objective.compute_advantages``, GRPO by default);
4. **one trainer group per model call**, holding that call's action and the episode's Â_i as a
   precomputed advantage (``Group.advantages``), trained by the same ``PivotRLTrainer`` and loss
   (``pivotrl_loss``: whole-action ratio of that call, clip, β·KL to π_ref) as PivotRL.

Relation to the spec: PivotRL's J_s averages K actions of one state; here the unit that receives
an advantage is an episode, and each of its model calls is an action of the loss with that
advantage (the multi-turn GRPO practice of sharing the trajectory's advantage over its turns). The
ratio is per model call (each call's whole-action probability ratio), not one product over the
whole episode: clipping then bounds every call's update separately. The loss is averaged over all
model calls of the batch, so long episodes weigh more, as they would in a token- or turn-level sum.
Tool outputs and user messages are inputs, never in the loss mask (the trainer masks the state).

Budget: the run stops after ``max_steps`` steps or, if ``max_generated_tokens`` is set, after
the first step at which the ledger's generated tokens reach it (matching PivotRL's rollout
budget in generated tokens), or, if ``max_model_calls`` is set, after the first step at which the
model calls of its episodes so far reach it (rollout turns: every model call of an episode is one
environment turn; matching PivotRL's probing and training samples), or, if ``max_wall_s`` is set,
after the first step that ends with the loop's wall time (seconds since ``run_e2e`` started, the
held-out curve's measurements left out) at or past it.

Held-out curve: with an ``evaluate`` hook and ``eval_every`` N > 0, the loop measures it as
PivotRL's loop does (:class:`pivotrl.training.loop.LoopHooks` ``evaluate``; the train stage's hook,
:func:`pivotrl.pipeline.curve.heldout_curve_hook`): before the first step (its columns prefixed
``heldout_before_`` on the first row), after every N steps and after the last. Every row carries
``rollout_turns``, the model calls of all episodes so far (this step's included), and the first
row ``heldout_before_rollout_turns`` = 0, the columns :func:`pivotrl.evaluation.learning_curve.learning_curve`
reads for its x in turns.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from pivotrl.data.schema import Trajectory
from pivotrl.core.errors import ConfigError, DataError
from pivotrl.evaluation.full_task import evaluate_full_tasks
from pivotrl.runtime.ledger import CostLedger
from pivotrl.objective import compute_advantages
from pivotrl.rollout.base import SamplingConfig
from pivotrl.training.pivotrl import Group

__all__ = ["E2E_REWARDS", "E2ESettings", "Episode", "collect_episodes", "e2e_step", "episode_groups", "episode_reward",
           "run_e2e"]

#: Episode rewards: all turns passed (0/1), or the fraction of turns passed.
E2E_REWARDS: tuple[str, ...] = ("full_task", "per_turn")
_SEP = "#e2e"


@dataclass(frozen=True)
class E2ESettings:
    """Settings of the end-to-end RL loop (the trainer's own settings are passed to it apart). Built
    from the validated config (``compare.e2e_*``, ``rollout``, ``training``), whose schema holds the
    bounds; nothing here checks them again.

    ``group_size`` K ≥ 2 episodes per task; ``tasks_per_batch`` ≥ 1; ``max_steps`` ≥ 1 steps;
    ``max_generated_tokens`` / ``max_model_calls`` / ``max_wall_s`` optional budgets (see the module
    docstring); ``eval_every`` N: the held-out curve's cadence (0 = off); ``reward`` one of
    :data:`E2E_REWARDS`; ``temperature`` > 0 and ``max_tokens`` per model call; ``max_steps_per_turn``
    executing calls per user turn (as in evaluation); ``max_context`` tokens; ``judge`` of the
    full-task runner (``"bfcl"`` or ``"pivotrl"``); ``advantage_estimator`` and ``delta`` as in
    PivotRL; ``seed`` of the task order and the sampling; ``weight_sync`` how π_old reaches the
    engine after each step (``"memory"`` | ``"disk"``, as ``rollout.weight_sync``), checked against
    the trainer with ``dtype``'s rule and ``refresh_tolerance`` nats per token (as PivotRL's loop).
    """

    group_size: int = 4
    tasks_per_batch: int = 2
    max_steps: int = 2
    max_generated_tokens: int | None = None
    max_model_calls: int | None = None
    max_wall_s: float | None = None
    eval_every: int = 0
    reward: str = "full_task"
    temperature: float = 1.0
    max_tokens: int = 64
    max_steps_per_turn: int = 4
    max_context: int = 2048
    judge: str = "bfcl"
    advantage_estimator: str = "grpo"
    delta: float = 1e-6
    seed: int = 0
    weight_sync: str = "disk"
    dtype: str = "fp32"
    refresh_tolerance: float = 1e-4


@dataclass
class Episode:
    """One played task: its model calls (prompt ids, action ids), judged outcome and reward."""

    task_id: str
    index: int  # 0..K-1 within its task's group
    calls: list[tuple[list[int], list[int]]]
    success: bool = False
    turns_passed: int = 0
    n_turns: int = 0
    tool_calls: int = 0
    reward: float = 0.0


def episode_reward(success: bool, turns_passed: int, n_turns: int, kind: str) -> float:
    """An episode's reward under ``kind`` (one of :data:`E2E_REWARDS`): ``"full_task"`` 1.0 if every user
    turn passed else 0.0; ``"per_turn"`` turns passed / turns (0.0 for a task without turns)."""
    if kind == "full_task":
        return 1.0 if success else 0.0
    return turns_passed / n_turns if n_turns else 0.0


def collect_episodes(
    engine: Any,
    tokenizer: Any,
    tasks: Sequence[Trajectory],
    settings: E2ESettings,
    *,
    step_seed: int,
    ledger: CostLedger | None = None,
    **runner_kwargs: Any,
) -> list[list[Episode]]:
    """Play K = ``settings.group_size`` episodes of every task with the full-task runner.

    ``runner_kwargs`` go to ``evaluate_full_tasks`` (``bfcl_root``, ``executor``, ``tool_style``,
    ...). Episode j of task t runs as a copy with id ``f"{t.id}#e2e{j}"`` in one batched run (the
    engine seeds each prompt of a batch apart). Returns one list of K episodes per task, in order;
    model calls, generated tokens and tool executions are added to ``ledger``. DataError for tasks
    with duplicate ids.
    """
    if len({t.id for t in tasks}) != len(tasks):
        raise DataError("collect_episodes: two tasks share an id")
    k = settings.group_size
    copies = [dataclasses.replace(t, id=f"{t.id}{_SEP}{j}") for t in tasks for j in range(k)]
    calls: dict[str, list[tuple[list[int], list[int]]]] = {c.id: [] for c in copies}
    gens: list[Any] = []

    def record(task_id: str, prompt_ids: list[int], gen: Any) -> None:
        calls[task_id].append((list(prompt_ids), list(gen.token_ids)))
        gens.append(gen)

    sampling = SamplingConfig(n=1, temperature=settings.temperature, max_tokens=settings.max_tokens, seed=step_seed)
    df, _ = evaluate_full_tasks(engine, tokenizer, copies, sampling=sampling, seed=step_seed,
                                max_steps_per_turn=settings.max_steps_per_turn, max_context=settings.max_context,
                                judge=settings.judge, on_model_call=record, **runner_kwargs)
    if ledger is not None:
        ledger.add_generations(gens)
        ledger.add(tool_executions=int(df["tool_calls"].sum()))
    rows = {r["task_id"]: r for r in df.to_dict("records")}
    out: list[list[Episode]] = []
    for t in tasks:
        group = []
        for j in range(k):
            cid = f"{t.id}{_SEP}{j}"
            r = rows[cid]
            ep = Episode(task_id=t.id, index=j, calls=calls[cid], success=bool(r["success"]),
                         turns_passed=int(r["turns_passed"]), n_turns=int(r["n_turns"]), tool_calls=int(r["tool_calls"]))
            ep.reward = episode_reward(ep.success, ep.turns_passed, ep.n_turns, settings.reward)
            group.append(ep)
        out.append(group)
    return out


def episode_groups(episodes: Sequence[Sequence[Episode]], settings: E2ESettings) -> list[Group]:
    """Trainer groups: one per model call, with its episode's group-relative advantage.

    Advantages per task over its K episode rewards (``settings.advantage_estimator``, δ). A model
    call with no action tokens is skipped (it cannot be trained on). Returns the groups in episode
    order; an episode without model calls contributes none.
    """
    groups: list[Group] = []
    for eps in episodes:
        rewards = torch.tensor([[e.reward for e in eps]], dtype=torch.float64)
        adv = compute_advantages(rewards, settings.advantage_estimator, settings.delta)[0].tolist()
        for e, a in zip(eps, adv):
            for c, (prompt, action) in enumerate(e.calls):
                if action:
                    groups.append(Group(state_id=f"{e.task_id}{_SEP}{e.index}/call{c}", prompt_ids=prompt,
                                        actions=[action], rewards=[e.reward], advantages=[float(a)]))
    return groups


def naive_tokens(groups: Sequence[Group], updates: int) -> int:
    """Trainer tokens without prefix sharing: Σ over actions of (state + action), per update."""
    return updates * sum(len(g.prompt_ids) + len(a) for g in groups for a in g.actions)


def e2e_step(trainer: Any, engine: Any, tokenizer: Any, tasks: Sequence[Trajectory], settings: E2ESettings, *,
             step: int, work_dir: str | Path, ledger: CostLedger, **runner_kwargs: Any) -> dict[str, float]:
    """One step: collect episodes, build groups, ``trainer.train_step``, refresh π_old in ``engine``.

    Returns metrics: ``step``, ``episodes``, ``reward_mean`` (episode rewards), ``success_rate``,
    ``model_calls``, ``groups`` (trained calls), the trainer's metrics prefixed ``train_`` and, after a
    step that updated the policy (``train_updates`` > 0), the refresh's ``refresh_s`` and check deltas
    (:func:`_refresh`).
    """
    with ledger.stage("rollout"):
        episodes = collect_episodes(engine, tokenizer, tasks, settings, step_seed=settings.seed * 100_003 + step,
                                    ledger=ledger, **runner_kwargs)
    flat = [e for eps in episodes for e in eps]
    groups = episode_groups(episodes, settings)
    metrics: dict[str, float] = {}
    refresh: dict[str, float] = {}
    if groups:
        with ledger.stage("train"):
            metrics = trainer.train_step(groups)
        ledger.add_trainer_metrics(metrics, naive_tokens(groups, int(metrics.get("updates", 0))))
    if metrics.get("updates"):  # a step without an update leaves the engine's weights as they are
        with ledger.stage("refresh"):
            refresh = _refresh(trainer, engine, groups[0], settings, step, Path(work_dir))
    return {
        "step": float(step + 1),
        "episodes": float(len(flat)),
        "reward_mean": sum(e.reward for e in flat) / len(flat),
        "success_rate": sum(e.success for e in flat) / len(flat),
        "model_calls": float(sum(len(e.calls) for e in flat)),
        "groups": float(len(groups)),
        **{f"train_{k}": float(v) for k, v in metrics.items()},
        **refresh,
    }


def _refresh(trainer: Any, engine: Any, group: Group, settings: E2ESettings, step: int,
             work_dir: Path) -> dict[str, float]:
    """Refresh π_old in ``engine`` the way PivotRL's loop does (``rollout.weight_sync``: ``memory`` =
    the trainer's shared-memory block, ``disk`` = an HF export read back), then check that it took:
    the engine's log-probs of the step's first trained group's actions against the trainer's
    (:func:`pivotrl.training.refresh_check.check_refresh`, raising TrainingError). → ``refresh_s``,
    ``refresh_max_abs_delta``, ``refresh_mean_abs_delta`` (nats per token)."""
    from pivotrl.training.refresh_check import check_refresh
    from pivotrl.training.rank_engines import refresh_delta, reload

    t0 = time.perf_counter()
    if settings.weight_sync == "memory":
        reload(engine, trainer.shared_weights())
    else:
        export = work_dir / f"policy-{step}"
        trainer.export_hf(str(export))
        reload(engine, str(export))
        shutil.rmtree(export, ignore_errors=True)
    refresh_s = time.perf_counter() - t0
    check = [a for a in group.actions if a]
    trainer_lps = trainer.group_logprobs(group.prompt_ids, check) if check else []
    d_max, d_mean = refresh_delta(engine, group.prompt_ids, check, trainer_lps)
    check_refresh(step + 1, d_max, d_mean, settings.refresh_tolerance, settings.dtype)
    return {"refresh_s": round(refresh_s, 4), "refresh_max_abs_delta": d_max, "refresh_mean_abs_delta": d_mean}


def run_e2e(trainer: Any, engine: Any, tokenizer: Any, tasks: Sequence[Trajectory], settings: E2ESettings, *,
            ledger: CostLedger | None = None, work_dir: str | Path | None = None,
            evaluate: Callable[[int], dict[str, float]] | None = None,
            **runner_kwargs: Any) -> tuple[list[dict[str, float]], CostLedger]:
    """The end-to-end RL loop over ``tasks`` (held in a seeded shuffled order, cycled).

    ``trainer``: a ``PivotRLTrainer`` built on π_ref (π_θ = π_ref at the start); ``engine``: a rollout
    engine holding the same weights. ``evaluate``: ``(step) -> {column: value}``, the held-out
    curve measured on ``engine`` at ``settings.eval_every``'s steps (module docstring; None = no
    curve). Returns ``(per-step metrics, ledger)``. The trained policy is the trainer's
    (``trainer.export_hf``). ConfigError when ``tasks`` is empty.
    """
    if not tasks:
        raise ConfigError("run_e2e: no training tasks (the pivot split has no task with an environment)")
    ledger = ledger if ledger is not None else CostLedger(name="e2e")
    order = list(range(len(tasks)))
    random.Random(settings.seed).shuffle(order)
    owned = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="pivotrl-e2e-")) if owned else Path(work_dir)
    history: list[dict[str, float]] = []
    curve = evaluate is not None and settings.eval_every > 0
    measured_s = 0.0  # the curve's measurements: not training, left out of the wall-time budget

    def measure(step: int) -> dict[str, float]:
        nonlocal measured_s
        t = time.perf_counter()
        out = dict(evaluate(step)) if evaluate is not None else {}
        measured_s += time.perf_counter() - t
        return out

    t0 = time.perf_counter()
    before = {k.replace("heldout_", "heldout_before_", 1): v for k, v in measure(0).items()} if curve else {}
    turns = 0
    try:
        pos = 0
        for step in range(settings.max_steps):
            batch = []
            for _ in range(min(settings.tasks_per_batch, len(tasks))):
                batch.append(tasks[order[pos % len(order)]])
                pos += 1
            row = e2e_step(trainer, engine, tokenizer, batch, settings, step=step, work_dir=work, ledger=ledger,
                           **runner_kwargs)
            turns += int(row["model_calls"])
            row["rollout_turns"] = float(turns)
            if step == 0:
                row.update(before, heldout_before_rollout_turns=0.0)
            stop = (step + 1 == settings.max_steps
                    or (settings.max_generated_tokens is not None
                        and ledger.generated_tokens >= settings.max_generated_tokens)
                    or (settings.max_model_calls is not None and turns >= settings.max_model_calls)
                    or (settings.max_wall_s is not None
                        and time.perf_counter() - t0 - measured_s >= settings.max_wall_s))
            if curve and ((step + 1) % settings.eval_every == 0 or stop):
                row.update(measure(step + 1))  # the engine serves the policy after this step
            history.append(row)
            if stop:
                break
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    return history, ledger
