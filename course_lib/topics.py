"""The course's topics: one short name per topic, carried by every file about it.

A topic's number is its lecture's place in the course; an assignment takes the number of
the lecture it follows. For the topic "zero":

    lectures/07_zero.ipynb           the lecture
    course_lib/zero.py               its plumbing (the lecture's code)
    course_lib/measure/zero/         what the lecture measures and draws, if long (optional;
                                     a package here, measure/<topic>.py where one file will do)
    solutions/a07_zero/a07_zero.ipynb    the assignment, and assignments/a07_zero/ (released)
    course_lib/grading/zero.py       the assignment's checks (and all the notebook imports)
    course_lib/grading/zero_*.py     parts of them, where one file would be too long to read
    tests/test_zero.py               tests of course_lib/zero.py
    tests/test_grading_zero.py       the checks against right and wrong implementations
    tests/cheats/a07_zero.py         cheats the checks refuse, right answers they accept

A module too long to read in one sitting becomes a package of files named by what a reader
looks for, its `__init__.py` gathering their names: `course_lib/costs/` (communication.py,
memory.py, ...), and so may a topic's module or its measurements (`course_lib/<topic>/`).

A part (`grading/zero_memory.py`) is imported by its topic's check module and by tests, never
by a notebook, and it never imports its topic's module: the checks stand on their parts.

This table is the one list of topics: the README's course table and the layout of the
repository are tested against it (tests/test_topics.py). Adding a topic starts with a row here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topic:
    number: int
    name: str
    title: str  # the lecture's heading: "# 7. ZeRO and FSDP: ..."
    module: bool = True  # does course_lib/<name>.py hold the lecture's code?
    assignment: str | None = None  # the assignment's heading, if one follows the lecture
    # What the assignment's graded test cells check, by name: the functions and classes the
    # student writes. The student edition's library defines none of them
    # (tests/test_student_edition.py); tests/test_topics.py holds them to the notebook.
    deliverables: tuple[str, ...] = ()

    @property
    def lecture(self) -> str:
        return f"lectures/{self.number:02d}_{self.name}.ipynb"

    @property
    def module_path(self) -> str | None:
        return f"course_lib/{self.name}.py" if self.module else None

    @property
    def assignment_name(self) -> str | None:
        return f"a{self.number:02d}_{self.name}" if self.assignment else None

    @property
    def solution(self) -> str | None:
        a = self.assignment_name
        return f"solutions/{a}/{a}.ipynb" if a else None

    @property
    def release(self) -> str | None:
        a = self.assignment_name
        return f"assignments/{a}/{a}.ipynb" if a else None

    @property
    def checks(self) -> str | None:
        return f"course_lib/grading/{self.name}.py" if self.assignment else None

    @property
    def tests(self) -> tuple[str, ...]:
        """The test files every topic of this kind has."""
        files = [f"tests/test_{self.name}.py"] if self.module else []
        if self.assignment:
            files += [
                f"tests/test_grading_{self.name}.py",
                f"tests/cheats/{self.assignment_name}.py",
            ]
        return tuple(files)

    def paths(self) -> tuple[str, ...]:
        """Every file the topic must have."""
        optional = (self.module_path, self.solution, self.release, self.checks)
        return (self.lecture, *(p for p in optional if p), *self.tests)


TOPICS = (
    Topic(0, "getting_started", "Getting started: many processes from one notebook cell", False),
    Topic(
        1,
        "processes",
        "Processes and pipes",
        assignment="processes and pipes",
        deliverables=(
            "ping",
            "pong",
            "relay",
            "run_chain",
            "dist_ping_pong",
            "round_trip_time",
            "spread",
        ),
    ),
    Topic(
        2,
        "collectives",
        "Collectives: all-reduce five ways",
        assignment="collectives from point-to-point",
        deliverables=(
            "broadcast",
            "reduce",
            "all_gather",
            "reduce_scatter",
            "all_reduce_naive",
            "bidirectional_ring_all_reduce",
            "all_reduce_fast",
        ),
    ),
    Topic(
        3,
        "data_parallel",
        "Data parallel: one model, many copies, one averaged gradient",
        assignment="data-parallel training",
        deliverables=("sync_gradients", "DDP", "communicate_less"),
    ),
    Topic(
        4,
        "gossip",
        "Decentralized training: no one waits for everyone",
        assignment="push-sum gossip",
        deliverables=("push_sum_step", "peer"),
    ),
    Topic(
        5,
        "compression",
        "Compressed communication: sending fewer bytes per step",
        assignment="compressed communication",
        deliverables=("quantize", "dequantize", "quantized_all_reduce", "PowerSGD", "Compressor"),
    ),
    Topic(6, "memory", "What training keeps in memory"),
    Topic(
        7,
        "zero",
        "ZeRO and FSDP: sharding what data parallelism copies",
        assignment="ZeRO, stages 1 to 3",
        deliverables=("ShardedOptimizer", "ShardedGradOptimizer", "shard_module"),
    ),
    Topic(
        8,
        "pipeline",
        "Pipeline parallelism: cutting the model into stages",
        assignment="pipeline parallelism",
        deliverables=("pipeline_step", "simulate_schedule", "optimal_partition", "split_schedule"),
    ),
    Topic(
        9,
        "tensor_parallel",
        "Tensor parallelism: splitting every layer across ranks",
        assignment="tensor parallelism",
        deliverables=(
            "ColumnParallelLinear",
            "RowParallelLinear",
            "ParallelMLP",
            "ParallelSelfAttention",
            "vocab_parallel_cross_entropy",
        ),
    ),
    Topic(
        10,
        "parallel_3d",
        "Putting it together: 3D parallelism",
        assignment="2-D parallel training, the capstone (bonus points)",
        deliverables=("process_grid", "make_groups", "GPT2D", "train_step", "ShardedAdamW"),
    ),
    Topic(
        11,
        "sequence_parallel",
        "Sequence parallelism: splitting the tokens",
        assignment="ring attention and Ulysses",
        deliverables=(
            "ring_attention_backward",
            "ulysses_attention_backward",
            "layout",
            "balanced_attention_backward",
        ),
    ),
    Topic(
        12,
        "expert_parallel",
        "Mixture of experts: experts on different ranks",
        assignment="an expert-parallel mixture of experts",
        deliverables=("expert_parallel_moe", "sync_router_grads", "dedup_moe"),
    ),
    Topic(13, "fault_tolerance", "Training that survives failures"),
)

# course_lib's machinery, used by every topic: not topics themselves.
LIBRARY = frozenset(
    {
        "__init__",
        "_integrity",
        "_stacks",
        "backends",
        "_worker",
        "_zygote",
        "rank_env",
        "calls",
        "comm",
        "comm_log",
        "compare",
        "costs",
        "counted_group",
        "data",
        "errors",
        "exercises",
        "launch",
        "magic",
        "meters",
        "models",
        "network",
        "plots",
        "pool",
        "progress",
        "protocol",
        "rank_process",
        "runtime",
        "sockets",
        "topics",
        "torchrun",
    }
)
# course_lib/grading's machinery: how checks run and how autograding works.
GRADING_LIBRARY = frozenset(
    {
        "__init__",
        "_harness",
        "answers",
        "messages",
        "limits",
        "training",
        "autograde",
        "verdicts",
        "batch",
        "course_admin",
        "judge",
        "leaderboard",
        "measurements",
        "provenance",
        "report",
        "sandbox",
        "traffic",
    }
)
# Tests of the machinery: tests/test_<name>.py for these names.
LIBRARY_TESTS = frozenset(
    {
        "autograde",
        "batch",
        "bench_cost",
        "browser",
        "cheats",
        "comm",
        "costs",
        "course_admin",
        "exchange",
        "exercises",
        "grading_harness",
        "grading_judge",
        "hub",
        "launch",
        "leaderboard",
        "models_data",
        "network",
        "notebook_kernel",
        "plots",
        "progress",
        "repository",
        "sandbox",
        "setup",
        "site",
        "sockets",
        "student_edition",
        "topics",
        "torchrun",
    }
)


def topic(name: str) -> Topic:
    """The topic called `name`."""
    for t in TOPICS:
        if t.name == name:
            return t
    raise KeyError(f"no topic {name!r}: the topics are {', '.join(t.name for t in TOPICS)}")
