"""Compressed gradient communication, measured (lecture 5).

    q = int8_chunks(grad, chunk_size=256)           # torch's int8 codes + an fp32 scale per chunk
    q.restored()                                    # within scale / 2 of grad, element by element
    compress_with_feedback(grad, error, TopK(0.01)) # error feedback: keep what was not sent
    EFMomentumSGD(params, lr=0.1, momentum=0.9)     # momentum on the decompressed average
    run = train_compressed("powersgd", batches, sizes=...)  # course_lib.measure.compression

Every method here is a DDP communication hook (`build_ddp`, with the training loop in
`course_lib.measure.compression`), so one loop runs them all and counts the same things: the
loss, the bytes sent (`CommCounter`) and the wall-clock time of every step, optionally on an
emulated slow network (`SlowNetwork`).

- "fp32": torch's `allreduce_hook`, the uncompressed reference (a ring all-reduce).
- "fp16", "bf16": torch's `fp16_compress_hook` and `bf16_compress_hook` (`bf16_hook`), the
  same all-reduce of gradients cast to 16 bits (`cast_error` measures what each cast does).
- "int8": `int8_hook`, torch's int8 quantization all-gathered (the design of torch's
  `quantization_perchannel_hook`, which fails on gloo), summed in fp32.
- "topk", "sign" and their "+ef" versions: `feedback_hook`, all-gathers of top-k or 1-bit
  compressed gradients, with or without error feedback.
- "dgc": deep gradient compression's top-k with momentum correction (`dgc_hook`).
- "vote": signSGD with majority vote (`majority_vote_hook`): 1-bit signs all-gathered, the
  sign of their sum applied (with `SGD`, a step of lr times +-1 per entry).
- "powersgd": torch's `powerSGD_hook` with `PowerSGDState(use_error_feedback=True,
  warm_start=True)`, the production reference (Assignment 5 builds PowerSGD from scratch).

By what a reader looks for:

    quantization.py     fewer bits per value: 16-bit casts, torch's int8 quantization per chunk
                        (`int8_chunks`), the bf16 and int8 hooks, the bytes of 8-bit all-reduces
    error_feedback.py   top-k and 1-bit compressors, error feedback, signSGD's majority vote,
                        DGC, `EFMomentumSGD`
    powersgd.py         PowerSGD's compression ratio; what torch's `powerSGD_hook` sends
    per_step.py         `METHODS` side by side: bytes, messages and network seconds per step

Import from `course_lib.compression` itself: every name is one here.
"""

from course_lib.compression.error_feedback import (
    BiasedCompressor,
    DGCState,
    EFMomentumSGD,
    FeedbackState,
    Sign,
    TopK,
    compress_with_feedback,
    compressed_mean,
    dgc_hook,
    feedback_hook,
    gather_payloads,
    majority_vote_hook,
)
from course_lib.compression.per_step import (
    METHODS,
    ONE_BUCKET_MB,
    bytes_per_step,
    comm_seconds,
    latency_steps,
)
from course_lib.compression.powersgd import (
    powersgd_bytes,
    powersgd_elements,
    powersgd_ratio,
)
from course_lib.compression.quantization import (
    CHUNK,
    LEVELS,
    Int8Chunks,
    QuantizeState,
    bf16_hook,
    cast_error,
    fp32_all_reduce_bytes,
    int8_allgather_bytes,
    int8_chunks,
    int8_hook,
    int8_two_phase_bytes,
)

__all__ = [
    "BiasedCompressor",
    "CHUNK",
    "DGCState",
    "EFMomentumSGD",
    "FeedbackState",
    "Int8Chunks",
    "LEVELS",
    "METHODS",
    "ONE_BUCKET_MB",
    "QuantizeState",
    "Sign",
    "TopK",
    "bf16_hook",
    "bytes_per_step",
    "cast_error",
    "comm_seconds",
    "compress_with_feedback",
    "compressed_mean",
    "dgc_hook",
    "feedback_hook",
    "fp32_all_reduce_bytes",
    "gather_payloads",
    "int8_allgather_bytes",
    "int8_chunks",
    "int8_hook",
    "int8_two_phase_bytes",
    "latency_steps",
    "majority_vote_hook",
    "powersgd_bytes",
    "powersgd_elements",
    "powersgd_ratio",
]
