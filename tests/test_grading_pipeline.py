"""Assignment 8's pipeline checks accept right implementations and reject wrong ones."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from course_lib import launch, rank, world_size
from course_lib.grading import (
    CheckFailed,
    check_optimal_partition,
    check_pipeline_trainer,
    check_simulate_schedule,
    check_split_schedule,
)
from course_lib.grading.pipeline import recv_tensor, schedule_order, send_tensor, simulate_split
from course_lib.grading.pipeline_partition import (
    PartitionProblem,
    brute_force_partition,
    partition_problems,
    partition_time,
)
from tests.adapters import mutant, planted, solution
from tests.cheats.a08_pipeline import (
    EXHAUSTIVE_PARTITION,
    GPIPE_BACKWARDS_REVERSED,
    PIPELINE_BY_OP_LIST,
    REBUILT_MODEL,
    SIMULATE_BY_FIXED_POINT,
    SIMULATE_GPIPE_REVERSED,
    SPLIT_BY_STAGE,
)

# --- the pipeline trainer -----------------------------------------------------------------


A08 = solution("pipeline")
pipeline_step = A08.pipeline_step
WARMUP = 'warmup = n_micro if schedule == "gpipe" else min(P - r - 1, n_micro)'
# Named mutations of the solution: the loss not divided by n_micro; 1F1B that runs every
# forward first (GPipe's memory); 1F1B with one warm-up forward too many.
step_unscaled = mutant(
    "pipeline", "pipeline_step", ("loss_fn(y, ys[i]) / n_micro", "loss_fn(y, ys[i])")
).pipeline_step
step_1f1b_keeps_everything = mutant(
    "pipeline", "pipeline_step", (WARMUP, "warmup = n_micro")
).pipeline_step
step_1f1b_one_too_many = mutant(
    "pipeline", "pipeline_step", ("min(P - r - 1, n_micro)", "min(P - r, n_micro)")
).pipeline_step
# Right numbers, wrong order or wrong manners: the backwards after the forwards in reverse
# micro-batch order (GPipe's, and 1F1B's cool-down); every micro-batch in reverse order;
# .grad zeroed first; the loss as a tensor; a float on every stage; sends never waited for.
COOL_DOWN = "for i in range(n_micro - warmup, n_micro):\n        backward(i)"
step_backwards_reversed = mutant(
    "pipeline",
    "pipeline_step",
    (COOL_DOWN, "for i in reversed(range(n_micro - warmup, n_micro)):\n        backward(i)"),
).pipeline_step
step_micro_batches_reversed = mutant(
    "pipeline",
    "pipeline_step",
    (
        "xs, ys = inputs.tensor_split(n_micro), targets.tensor_split(n_micro)",
        "xs, ys = inputs.tensor_split(n_micro)[::-1], targets.tensor_split(n_micro)[::-1]",
    ),
).pipeline_step
step_zeroes_first = mutant(
    "pipeline",
    "pipeline_step",
    ("r, P = rank(), world_size()", "stage.zero_grad()\n    r, P = rank(), world_size()"),
).pipeline_step
step_returns_a_tensor = mutant(
    "pipeline",
    "pipeline_step",
    ("return total if last else None", "return torch.tensor(total) if last else None"),
).pipeline_step
step_returns_everywhere = mutant(
    "pipeline", "pipeline_step", ("return total if last else None", "return total")
).pipeline_step
step_never_waits = mutant(
    "pipeline", "pipeline_step", ("for send in sends:\n        send.wait()", "pass")
).pipeline_step
step_shifted_activation = mutant(
    "pipeline",
    "pipeline_step",
    ("recv_tensor(r - 1).requires_grad_()", "(recv_tensor(r - 1) + 1e-3).requires_grad_()"),
).pipeline_step
# No messages at all: each stage rebuilds the model from the run's seed and computes the
# other stages itself (the cheat's own text); the stages' secret weights defeat it.
step_rebuilds_the_model = planted("pipeline", "pipeline_step", REBUILT_MODEL).pipeline_step


def step_zeroes_between_micro_batches(stage, *args):
    class Zeroing(torch.nn.Module):
        def forward(self, x):
            stage.zero_grad()
            return stage(x)

    return pipeline_step(Zeroing(), *args)


def step_never_sends_gradients(stage, inputs, targets, loss_fn, n_micro, schedule):
    """Stage r > 0 never sends the input's gradient back: stage r - 1 waits forever."""
    r, P = rank(), world_size()
    outputs = []
    for x, y in zip(inputs.tensor_split(n_micro), targets.tensor_split(n_micro), strict=True):
        x = x if r == 0 else recv_tensor(r - 1).requires_grad_()
        out = stage(x)
        if r < P - 1:
            send_tensor(out, r + 1).wait()
        outputs.append(out if r < P - 1 else loss_fn(out, y) / n_micro)
    for out in outputs:
        out.backward(None if r == P - 1 else recv_tensor(r + 1))
    return sum(o.item() for o in outputs) if r == P - 1 else None


def step_broadcasts(stage, inputs, targets, loss_fn, n_micro, schedule):
    """Right numbers, but a collective (a barrier) on every rank."""
    dist.barrier()
    return pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)


def step_as_1f1b(stage, inputs, targets, loss_fn, n_micro, schedule):
    """Right 1F1B, whatever schedule is asked for."""
    return pipeline_step(stage, inputs, targets, loss_fn, n_micro, "1f1b")


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


def test_send_tensor_carries_shape_and_dtype():
    def exchange():
        if rank() == 0:
            sends = [
                send_tensor(torch.arange(6.0, dtype=torch.float64).view(2, 3), 1),
                send_tensor(torch.tensor(7), 1),
            ]
            for send in sends:
                send.wait()
            return None
        return [recv_tensor(0), recv_tensor(0)]

    received = launch(exchange, world_size=2, timeout=20)[1]
    assert torch.equal(received[0], torch.arange(6.0, dtype=torch.float64).view(2, 3))
    assert received[1].dtype == torch.int64 and received[1].shape == () and received[1] == 7


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_trainer_accepts_a_right_implementation(schedule, capsys):
    sizes, gpt_stages = ((1, 3, 4), 4) if schedule == "gpipe" else ((2, 3, 4), 2)
    check_pipeline_trainer(pipeline_step, schedule, world_sizes=sizes)
    check_pipeline_trainer(
        pipeline_step, schedule, world_sizes=(gpt_stages,), models=("gpt",), seed=3
    )
    out = capsys.readouterr().out
    assert out.startswith("check_pipeline_trainer: passed. Verified 9 run(s) of 2 steps (mlp;")
    assert f"stages), {schedule}: every stage's gradients and the loss" in out


def test_the_reversed_gpipe_cheat_is_right_but_for_its_order():
    # The cheat's text: the gradients and the loss are right, only GPipe's order is not.
    step = planted("pipeline", "pipeline_step", GPIPE_BACKWARDS_REVERSED).pipeline_step
    check_pipeline_trainer(step, "1f1b", world_sizes=(2, 4))
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(step, "gpipe", world_sizes=(2,), n_micro=(4,))
    assert "the stage ran F0 F1 F2 F3 B3 B2 B1 B0; the gpipe schedule runs" in str(info.value)
    assert "differs" not in str(info.value)


def test_pipeline_trainer_accepts_a_different_right_implementation():
    # An explicit list of operations, torch.autograd.backward, the loss summed as a tensor
    # and returned with float() (the cheats' alternative text).
    step = planted("pipeline", "pipeline_step", PIPELINE_BY_OP_LIST).pipeline_step
    for schedule in ("gpipe", "1f1b"):
        check_pipeline_trainer(step, schedule, world_sizes=(1, 3, 4), n_micro=(2, 16))


def test_schedule_orders_keep_the_documented_number_in_flight():
    for P, m in [(4, 8), (4, 2), (2, 5), (1, 3)]:
        for r in range(P):
            for schedule, bound in (("gpipe", m), ("1f1b", min(m, P - r))):
                order = schedule_order(schedule, P, m, r)
                kinds = [kind for kind, _ in order]
                live = [kinds[: k + 1].count("F") - kinds[: k + 1].count("B") for k in range(2 * m)]
                assert max(live) == bound and live[-1] == 0, (schedule, P, m, r)
                for kind in "FB":  # each kind takes the micro-batches in order
                    assert [i for k, i in order if k == kind] == list(range(m))


@pytest.mark.parametrize(
    "fn, schedule, message",
    [
        (step_unscaled, "gpipe", "it is n_micro = 4 times the full-batch gradient"),
        (step_1f1b_keeps_everything, "1f1b", "held the activations of 4 micro-batches at once"),
        (step_1f1b_one_too_many, "1f1b", "held the activations of 3 micro-batches"),
        (step_zeroes_between_micro_batches, "1f1b", "do not zero gradients"),
        (step_never_sends_gradients, "gpipe", "did not finish within 5 s"),
        (step_broadcasts, "gpipe", "used ['barrier']"),
        (step_as_1f1b, "gpipe", "the gpipe schedule runs F0 F1 F2 F3 B0 B1 B2 B3 on stage 0 of 2"),
        (
            step_backwards_reversed,
            "gpipe",
            "the stage ran F0 F1 F2 F3 B3 B2 B1 B0; the gpipe schedule runs F0 F1 F2 F3 B0 B1 "
            "B2 B3 on stage 0 of 2",
        ),
        (
            step_backwards_reversed,
            "1f1b",
            "the stage ran F0 F1 F2 F3 B0 B3 B2 B1; the 1f1b schedule runs F0 F1 F2 F3 B0 B1 "
            "B2 B3 on stage 0 of 4",
        ),
        (step_micro_batches_reversed, "gpipe", "the stage ran F3 F2 F1 F0 B3 B2 B1 B0;"),
        (step_zeroes_first, "gpipe", "it is the full-batch gradient alone: what .grad held"),
        (step_returns_a_tensor, "gpipe", "the last stage returned a Tensor; return the whole"),
        (step_returns_everywhere, "1f1b", "the stage returned a float; only the last stage"),
        (step_never_waits, "gpipe", "send(s) that send_tensor started were never .wait()-ed"),
        (
            step_shifted_activation,
            "gpipe",
            "forward number 1 of the stage got an input that is no micro-batch's activation "
            "from stage 0",
        ),
        (step_rebuilds_the_model, "gpipe", "sent stage 1 0 bytes, fewer than the"),
        (step_rebuilds_the_model, "1f1b", "sent stage 1 0 bytes, fewer than the"),
        (not_implemented, "gpipe", "raised NotImplementedError"),
    ],
)
def test_pipeline_trainer_rejects_wrong_implementations(fn, schedule, message):
    # A deadlock is cut after its timeout (5 s); the others finish, given time on a machine
    # that other jobs load (5 s was too short with 13 processes on 2 cores).
    deadlock = "did not finish" in message
    start = time.monotonic()
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(fn, schedule, timeout=5 if deadlock else 30)
    assert str(info.value).startswith("check_pipeline_trainer: ")
    assert message in str(info.value)
    assert not deadlock or time.monotonic() - start < 30


def test_pipeline_failure_names_stage_step_and_tolerance():
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(step_unscaled, "1f1b", world_sizes=(2,), n_micro=(2,))
    text = str(info.value)
    assert "stage 0, step 0 (mlp model, batch of 16 in 2 micro-batches, 2 stages" in text
    assert "(allowed atol=1e-10 + rtol=1e-10 * |expected|)" in text


def test_one_micro_batch_cannot_tell_the_loss_scaling():
    # With n_micro = 1 the scaling is 1: the bug shows only from 2 micro-batches on.
    check_pipeline_trainer(step_unscaled, "gpipe", world_sizes=(2,), n_micro=(1,))


def test_bad_pipeline_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown schedule 'interleaved'"):
        check_pipeline_trainer(pipeline_step, "interleaved")
    with pytest.raises(ValueError, match="n_micro=3 does not divide the batch of 16"):
        check_pipeline_trainer(pipeline_step, "gpipe", n_micro=(3,))


# --- simulated schedules ------------------------------------------------------------------


simulate_schedule = A08.simulate_schedule
# Named mutations: the bubble formula off by one; every operation one time unit late; 1F1B
# run as GPipe.
simulate_off_by_one = mutant(
    "pipeline",
    "simulate_schedule",
    ('"bubble_fraction": 1 - busy / (P * makespan)', '"bubble_fraction": (P - 1) / (m + P)'),
).simulate_schedule
simulate_with_a_gap = mutant(
    "pipeline",
    "simulate_schedule",
    ("end[dependency] if dependency", "end[dependency] + 1.0 if dependency"),
).simulate_schedule
simulate_1f1b_as_gpipe = mutant(
    "pipeline",
    "simulate_schedule",
    ('warmup = m if schedule == "gpipe" else min(P - s - 1, m)', "warmup = m"),
).simulate_schedule


def simulate_without_dependencies(P, m, schedule, t_forward=1.0, t_backward=1.0):
    result = simulate_schedule(P, m, schedule, t_forward, t_backward)
    for s, ops in enumerate(result["timeline"]):  # every stage starts at once
        shift = ops[0][2]
        result["timeline"][s] = [(k, i, a - shift, b - shift) for k, i, a, b in ops]
    return result


def simulate_late_forward(P, m, schedule, t_forward=1.0, t_backward=1.0):
    """Right but for one forward: from 3 stages on, 1F1B's first stage runs its first forward
    after the warm-up one t_forward late, which its idle time hides (the makespan and the
    bubble stay right)."""
    result = simulate_schedule(P, m, schedule, t_forward, t_backward)
    ops = result["timeline"][0]
    if schedule == "1f1b" and 3 <= P <= m:
        k, i, a, b = ops[P - 1]
        ops[P - 1] = (k, i, a + t_forward, b + t_forward)
    return result


def simulate_listed_backwards(P, m, schedule, t_forward=1.0, t_backward=1.0):
    """Right times, but each stage lists its operations forwards first, not as they run."""
    result = simulate_schedule(P, m, schedule, t_forward, t_backward)
    result["timeline"] = [sorted(ops, key=lambda op: op[0] == "B") for ops in result["timeline"]]
    return result


# The cheats' texts: GPipe's backwards simulated in reverse order (a mirror image, the same
# bubble); another right simulator, relaxed to a fixed point.
simulate_gpipe_reversed = planted(
    "pipeline", "simulate_schedule", SIMULATE_GPIPE_REVERSED
).simulate_schedule
simulate_by_fixed_point = planted(
    "pipeline", "simulate_schedule", SIMULATE_BY_FIXED_POINT
).simulate_schedule


@pytest.mark.parametrize("fn", [simulate_schedule, simulate_by_fixed_point])
def test_simulate_schedule_accepts_right_implementations(fn):
    check_simulate_schedule(fn, cases=((1, 3), (2, 2), (4, 16), (5, 3), (8, 1), (2, 7), (8, 16)))


def test_simulated_bubble_is_the_formula_for_the_issue_cases():
    for m in (1, 4, 16):
        for schedule in ("gpipe", "1f1b"):
            result = simulate_schedule(4, m, schedule, t_backward=2.0)
            assert result["bubble_fraction"] == pytest.approx(3 / (m + 3), abs=1e-12)
            assert result["makespan"] == pytest.approx((m + 3) * 3.0)


@pytest.mark.parametrize(
    "fn, message",
    [
        (simulate_off_by_one, "bubble_fraction is 0.333"),
        (simulate_with_a_gap, "but it could start at 1, when the stage is free and what it"),
        (simulate_late_forward, "stage 0 starts F3 at 4, but it could start at 3, when"),
        (simulate_listed_backwards, "list stage 1's operations in the order they run"),
        (
            simulate_gpipe_reversed,
            "stage 0 runs F0 F1 F2 F3 B3 B2 B1 B0; the gpipe schedule runs F0 F1 F2 F3 B0 B1 "
            "B2 B3 there",
        ),
        (
            simulate_1f1b_as_gpipe,
            "stage 1 has 4 micro-batches in flight at once; 1F1B keeps at most min(m, P - s) = 3",
        ),
        (simulate_without_dependencies, "but it needs F0 of stage 0, which ends at 1"),
        (not_implemented, "raised NotImplementedError"),
    ],
)
def test_simulate_schedule_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_simulate_schedule(fn)
    assert str(info.value).startswith("check_simulate_schedule: ")
    assert message in str(info.value)


# --- the optimal partition ----------------------------------------------------------------


optimal_partition = A08.optimal_partition


def partition_greedy(layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None):
    """Wrong: one machine per stage, layers cut where the running time passes its share (its
    time computed as an answer would, without the grader's helpers)."""
    n = len(layer_times)
    k = min(n, n_machines)
    share, stages, start, acc = sum(layer_times) / k, [], 0, 0.0
    for j, t in enumerate(layer_times):
        acc += t
        left = k - len(stages) - 1
        if left and acc >= share and n - (j + 1) >= left:
            stages.append([start, j + 1, 1])
            start, acc = j + 1, 0.0
    stages.append([start, n, 1])
    stages[-1][2] += n_machines - sum(s[2] for s in stages)
    weights = weight_sizes if weight_sizes is not None else [0.0] * n

    def stage_time(i, j, machines):
        sync = sum(2 * w / bandwidth for w in weights[i:j]) if machines > 1 else 0.0
        return max(sum(layer_times[i:j]), sync) / machines

    links = [2 * activation_sizes[b - 1] / bandwidth for _, b, _ in stages[:-1]]
    return max([stage_time(*s) for s in stages] + links), [tuple(s) for s in stages]


def partition_ignoring_communication(layer_times, activation_sizes, n_machines, **kwargs):
    value, stages = optimal_partition(
        layer_times, [0.0] * len(activation_sizes), n_machines, **kwargs
    )
    return value, stages


# Named mutation: the last stage always gets one machine (m' = 1 only).
partition_one_machine_per_stage = mutant(
    "pipeline",
    "optimal_partition",
    ("for m_last in range(1, m):", "for m_last in range(1, min(m, 2)):"),
).optimal_partition


def test_optimal_partition_accepts_a_right_implementation():
    check_optimal_partition(optimal_partition, seeds=(0, 1, 2, 3, 4, 5))


def test_brute_force_agrees_with_a_hand_solved_case():
    # 4, 1, 1, 1, 1 on 2 machines: {4} | {1, 1, 1, 1} takes 4; nothing beats the slow layer.
    problem = PartitionProblem((4.0, 1.0, 1.0, 1.0, 1.0), (0.1,) * 5, 2)
    assert brute_force_partition(problem) == 4.0
    # 6, 1, 1 on 3 machines: all layers on 3 replicas (8/3) beats one machine per stage (6).
    problem = PartitionProblem((6.0, 1.0, 1.0), (0.1,) * 3, 3)
    assert brute_force_partition(problem) == pytest.approx(8.0 / 3)
    assert partition_time(problem, [(0, 1, 1), (1, 2, 1), (2, 3, 1)]) == 6.0
    # A cut where the activation is large costs 2 a / bandwidth: 10 here, so cut elsewhere.
    problem = PartitionProblem((1.0, 1.0, 1.0, 1.0), (0.2, 5.0, 0.2, 1.0), 2, (1.0,) * 4)
    assert partition_time(problem, [(0, 2, 1), (2, 4, 1)]) == 10.0
    assert brute_force_partition(problem) == 3.0
    # Weight sync: replicas of a layer with w = 4.5 all-reduce for 2 * 4.5 = 9 > 6 computing.
    problem = PartitionProblem((6.0,), (0.0,), 3, (4.5,))
    assert brute_force_partition(problem) == pytest.approx(3.0)


def test_the_problems_separate_the_wrong_partitions():
    problems = partition_problems((0,))
    for wrong in (
        partition_greedy,
        partition_ignoring_communication,
        partition_one_machine_per_stage,
    ):
        assert any(
            wrong(*p.args(), **p.kwargs())[0] > brute_force_partition(p) + 1e-9
            or wrong(*p.args(), **p.kwargs())[0]
            != partition_time(p, wrong(*p.args(), **p.kwargs())[1])
            for p in problems
        ), wrong.__name__


@pytest.mark.parametrize(
    "fn, message",
    [
        (partition_greedy, "the best split takes"),
        (partition_ignoring_communication, "but its stages"),
        (partition_one_machine_per_stage, "the best split takes"),
        (not_implemented, "raised NotImplementedError"),
    ],
)
def test_optimal_partition_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_optimal_partition(fn)
    assert str(info.value).startswith("check_optimal_partition: ")
    assert message in str(info.value)


# --- answers that are not the student's own work ---------------------------------------------


# Right, but exponential: every cut and every split of the machines (the cheat's own text).
partition_exhaustive = planted(
    "pipeline", "optimal_partition", EXHAUSTIVE_PARTITION
).optimal_partition


def partition_from_the_lecture(
    layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None
):
    """Right: the lecture's dynamic program, its stages renumbered."""
    from course_lib.pipeline import optimal_partition as lecture

    found = lecture(layer_times, activation_sizes, n_machines, bandwidth, weight_sizes)
    return found.time, [(s.first, s.last + 1, s.machines) for s in found.stages]


def step_from_the_lecture(stage, inputs, targets, loss_fn, n_micro, schedule):
    from course_lib import pipeline

    return pipeline.pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)


def test_large_problems_take_a_dynamic_program_not_a_search(capsys):
    check_optimal_partition(optimal_partition, seeds=(), large=(0, 1))
    assert " small and 2 large problem(s): every returned split covers" in (capsys.readouterr().out)
    with pytest.raises(CheckFailed, match="exponential time; the dynamic program"):
        check_optimal_partition(partition_exhaustive, seeds=(), large=(0,), large_timeout=3)
    # The exhaustive search is right where it can finish: only its time is refused.
    check_optimal_partition(partition_exhaustive, seeds=(0,))


def test_the_lectures_implementations_are_refused():
    with pytest.raises(CheckFailed, match="runs course_lib.pipeline.optimal_partition "):
        check_optimal_partition(partition_from_the_lecture)
    with pytest.raises(CheckFailed, match="runs course_lib.pipeline.pipeline_step[ ,]"):
        check_pipeline_trainer(step_from_the_lecture, "gpipe", world_sizes=(2,), n_micro=(2,))


# --- Part 4 (open): a split-backward schedule, a smaller bubble in 1F1B's memory -------------

split_schedule = A08.split_schedule
split_by_stage = planted("pipeline", "split_schedule", SPLIT_BY_STAGE).split_schedule  # also right
split_holds_one_more = mutant(
    "pipeline", "split_schedule", ("f[s] - w[s] < P", "f[s] - w[s] <= P")
).split_schedule


def split_1f1b(P, m):
    """1F1B with each backward split, its W right after its B."""
    orders = []
    for s in range(P):
        w = min(P - s - 1, m)
        order = [("F", i) for i in range(w)]
        for i in range(m - w):
            order += [("F", w + i), ("B", i), ("W", i)]
        orders.append(order + [op for i in range(m - w, m) for op in (("B", i), ("W", i))])
    return orders


def split_gpipe(P, m):
    return [[(k, i) for k in "FBW" for i in range(m)] for _ in range(P)]


def split_w_before_b(P, m):
    orders = split_schedule(P, m)
    orders[1] = [("W", 0), *[op for op in orders[1] if op != ("W", 0)]]
    return orders


def split_deadlocks(P, m):
    """Stage 0 runs one micro-batch at a time; stage 1 waits for its second forward first."""
    return [[(k, i) for i in range(m) for k in "FBW"], *split_1f1b(P, m)[1:]]


def split_from_the_lecture(P, m):
    from course_lib.measure.pipeline import zero_bubble_order

    return [[(op.kind, op.micro) for op in ops] for ops in zero_bubble_order(P, m)]


def test_split_schedule_accepts_the_solution_and_a_different_answer(capsys):
    for fn in (split_schedule, split_by_stage):
        check_split_schedule(fn, cases=((2, 4), (3, 6), (4, 4), (4, 8), (5, 5), (6, 12)))
        out = capsys.readouterr().out
        assert out.startswith("check_split_schedule: passed."), out
    assert split_by_stage(4, 8) != split_schedule(4, 8)  # another order, also right


def test_split_measurements_against_1f1b():
    """Measured by the check's simulator (unit ops): 1F1B split takes 3m + 2(P - 1), GPipe's
    order the same, the lecture's zero bubble (P - s in flight on stage s) too; the solution
    (P on every stage) 15 units at P = m = 4 (ZB-H1's 3m + P - 1) and 29 at P = 4, m = 8."""
    for P, m, want in ((4, 4, 15), (4, 8, 29), (6, 6, 23), (6, 12, 43)):
        assert simulate_split(P, split_schedule(P, m))["makespan"] == want
        assert max(simulate_split(P, split_schedule(P, m))["peaks"]) == P
        for fn in (split_1f1b, split_gpipe, split_from_the_lecture):
            assert simulate_split(P, fn(P, m))["makespan"] == 3 * m + 2 * (P - 1)
    assert simulate_split(4, split_1f1b(4, 8))["peaks"] == [4, 3, 2, 1]
    assert simulate_split(4, split_deadlocks(4, 8))["stuck"] == {
        0: ("B", 0),
        **{s: ("F", 1) for s in (1, 2, 3)},
    }


@pytest.mark.parametrize(
    "fn, message",
    [
        (split_1f1b, "split_schedule(4, 4): the step takes 18 units, bubble 0.333; at most 17"),
        (split_gpipe, "split_schedule(4, 8): stage 0 holds 8 micro-batches at once"),
        (split_holds_one_more, "split_schedule(4, 8): stage 0 holds 5 micro-batches at once"),
        (split_w_before_b, "stage 1 runs W0 before B0; W of a micro-batch needs its B"),
        (split_deadlocks, "deadlocks: no stage can go on (stage 0 at B0, which needs B0 of"),
        (split_from_the_lecture, "runs course_lib.measure.pipeline.zero_bubble_order"),
    ],
)
def test_split_schedule_rejects(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_split_schedule(fn)
    assert message in str(info.value), str(info.value)
