"""A model of the GPU case on paper, fed by figures measured on CPU in the same benchmark run.

Why: no GPU here, yet the question users ask is "what will checkpointing every iteration cost my
70B run on 180 A100s?". The engine's behaviour splits into parts that do not depend on the device
(per-tensor and per-byte bookkeeping on the host, the flush's efficiency against the storage's raw
speed: both measured on CPU) and parts that are hardware (PCIe, node storage, file system: taken
from the paper's setup and docs/SLURM.md). The model combines them.

Notation (per checkpoint): ``C`` bytes of all ranks, ``G`` GPUs on ``N`` nodes, ``S = C / G`` per
GPU, ``F + B`` forward + backward seconds, ``U`` update seconds, ``T = F + B + U`` one iteration,
``k`` iterations between checkpoints.

* **Bookkeeping** ``t_book = a + b * S``: the host work ``save()`` and the wait do on the training
  thread (planning, the layout, handing chunks to the copier). ``a`` and ``b`` are the least-squares
  fit of the engine's blocked time over the state sizes measured on CPU (there the compute between
  save and wait is longer than the copy, so the blocked time is only this bookkeeping).
* **Device-to-host copy** ``t_d2h = S / B_pcie`` (``B_pcie`` = 25 GB/s per A100, PCIe Gen4). The
  copy is lazy: it only has to end before the next update, so it hides under ``F + B`` and stalls
  ``max(0, t_d2h - (F + B))``.
* **Flush** ``t_flush = (C / N) / (eta * B_node)``, with ``B_node = min(node link, file system /
  N)`` (Lustre 650 GB/s aggregate, one HDR-200 port 25 GB/s per node) and ``eta`` the engine's
  measured flush / O_DIRECT-write ratio (at most 1). With a host cache of one shard per GPU (the
  configs' setting) the next snapshot waits for the previous flush: it stalls
  ``max(0, t_flush - k * T)``.
* **Stall per checkpoint** ``= t_book + max(0, t_d2h - (F + B)) + max(0, t_flush - k * T)``:
  the seconds training is blocked; **end-to-end overhead** ``= stall / (k * T)``.
* **Seconds until durable** ``= t_book + max(t_d2h, t_flush)``: the flush streams each chunk as
  soon as it lands in the host cache, so the copy and the flush overlap; the checkpoint is on the
  file system when the slower of the two ends.

The paper's "checkpoint throughput" ``C / stall`` is not computed: it divides the checkpoint's
size by a time in which those bytes are not moved (millions of GB/s for a millisecond stall), so
it says nothing a reader can compare with a bandwidth. The paper's figures are shown as the stall
seconds they imply.

Assumptions: iteration time at 180 GPUs equals the paper's 20-node 70B iteration (the global batch
is not in the paper; docs/SLURM.md); the copy does not slow the compute (separate copy engine, host
cores idle); every rank flushes in parallel and the file system is shared fairly; bookkeeping
measured on these 2 CPU cores carries over to a GPU node's host cores (conservative: those are
faster and less loaded).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# The paper's setup (DataStates-LLM, HPDC 2024) and the 180-GPU layout of docs/SLURM.md.
PCIE_GBPS = 25.0            # device-to-host per A100, PCIe Gen4
LUSTRE_GBPS = 650.0         # aggregate file system bandwidth
NODE_LINK_GBPS = 25.0       # one HDR-200 port per node
GPUS_PER_NODE = 4
LLAMA2_70B = {"checkpoint_gb": 1065.0, "forward_s": 6.71, "backward_s": 16.82, "update_s": 0.12}
#: The paper's every-iteration checkpoint throughput for 70B on 20 nodes (GB/s): DataStates and DeepSpeed.
PAPER_70B_GBPS = {"datastates": 638.0, "deepspeed": 54.0}


@dataclass
class Prediction:
    gpus: int
    nodes: int
    interval: int
    per_gpu_gb: float
    per_node_gb: float
    bookkeeping_s: float
    d2h_s: float
    d2h_stall_s: float
    flush_s: float
    flush_stall_s: float
    stall_s: float
    iteration_s: float
    overhead: float
    durable_s: float


def fit_bookkeeping(sizes_bytes: list[float], blocked_s: list[float]) -> tuple[float, float]:
    """Least-squares ``blocked = a + b * bytes`` over the measured sizes; ``a, b >= 0``."""
    if len(sizes_bytes) != len(blocked_s) or not sizes_bytes:
        raise ValueError("need one blocked time per size, at least one")
    n = len(sizes_bytes)
    mean_x = sum(sizes_bytes) / n
    mean_y = sum(blocked_s) / n
    var = sum((x - mean_x) ** 2 for x in sizes_bytes)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes_bytes, blocked_s)) / var if var > 0 else 0.0
    b = max(b, 0.0)
    return max(mean_y - b * mean_x, 0.0), b


def predict(a_s: float, b_s_per_byte: float, flush_efficiency: float, gpus: int = 180, interval: int = 1,
            model: dict = LLAMA2_70B) -> Prediction:
    """Stall and end-to-end overhead of checkpointing every ``interval`` iterations on ``gpus`` A100s."""
    if gpus % GPUS_PER_NODE:
        raise ValueError(f"{gpus} GPUs do not fill nodes of {GPUS_PER_NODE}")
    nodes = gpus // GPUS_PER_NODE
    c = model["checkpoint_gb"] * 1e9
    per_gpu = c / gpus
    fwd_bwd = model["forward_s"] + model["backward_s"]
    iteration = fwd_bwd + model["update_s"]
    book = a_s + b_s_per_byte * per_gpu
    d2h = per_gpu / (PCIE_GBPS * 1e9)
    d2h_stall = max(0.0, d2h - fwd_bwd)
    node_gbps = min(NODE_LINK_GBPS, LUSTRE_GBPS / nodes) * min(max(flush_efficiency, 1e-6), 1.0)
    flush = c / nodes / (node_gbps * 1e9)
    flush_stall = max(0.0, flush - interval * iteration)
    stall = book + d2h_stall + flush_stall
    return Prediction(gpus, nodes, interval, per_gpu / 1e9, c / nodes / 1e9, book, d2h, d2h_stall, flush,
                      flush_stall, stall, iteration, stall / (interval * iteration), book + max(d2h, flush))


def model_from_measurements(sizes_bytes: list[float], blocked_s: list[float], flush_efficiency: float,
                            trainer_blocked_s_per_byte: float | None = None) -> dict:
    """Predictions for 70B on 180 GPUs (every 1 and 10 iterations) and on the paper's 80, with their inputs.

    Two bounds for the bookkeeping: ``engine`` (the fit of the engine's own blocked time: the lower
    bound) and, when given, ``trainer`` (the reference trainer's blocked time per checkpointed byte:
    an upper bound, since on CPU it also holds the state-dict building and a copy that competes
    with the ranks for the two cores, work a GPU node leaves to the copy engine and idle cores).
    """
    a, b = fit_bookkeeping(sizes_bytes, blocked_s)
    bounds = {"engine": (a, b)}
    if trainer_blocked_s_per_byte is not None:
        bounds["trainer"] = (0.0, trainer_blocked_s_per_byte)
    runs = {f"{bound}/{g}gpu/every{k}": {"bookkeeping": bound, **asdict(predict(fa, fb, flush_efficiency, g, k))}
            for bound, (fa, fb) in bounds.items() for g in (180, 80) for k in (1, 10)}
    return {"inputs": {"bookkeeping_fixed_s": a, "bookkeeping_s_per_gb": b * 1e9,
                       "trainer_blocked_s_per_gb": None if trainer_blocked_s_per_byte is None
                       else trainer_blocked_s_per_byte * 1e9,
                       "flush_efficiency": flush_efficiency, "pcie_gbps": PCIE_GBPS, "lustre_gbps": LUSTRE_GBPS,
                       "node_link_gbps": NODE_LINK_GBPS, "model": LLAMA2_70B},
            "predictions": runs, "paper_70b_80gpu_gbps": PAPER_70B_GBPS}


def format_model(m: dict) -> str:
    i = m["inputs"]
    trainer = ("" if i["trainer_blocked_s_per_gb"] is None
               else f", reference trainer blocked {i['trainer_blocked_s_per_gb'] * 1000:.1f} ms per GB checkpointed")
    lines = [f"Inputs measured in this run: engine bookkeeping {i['bookkeeping_fixed_s'] * 1000:.2f} ms + "
             f"{i['bookkeeping_s_per_gb'] * 1000:.3f} ms/GB{trainer}; flush efficiency {i['flush_efficiency']:.2f} "
             f"of the O_DIRECT write. Hardware: PCIe {i['pcie_gbps']:.0f} GB/s per GPU, Lustre {i['lustre_gbps']:.0f} "
             f"GB/s, node link {i['node_link_gbps']:.0f} GB/s; 70B checkpoint {i['model']['checkpoint_gb']:.0f} GB.", "",
             "| bookkeeping from | GPUs | every | **stall s** (training blocked) | **until durable s** | "
             "end-to-end overhead | per GPU GB | per node GB | d2h s (limit: PCIe; hidden under fwd+bwd) | "
             "flush s (limit: node link / Lustre share) | iteration s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in m["predictions"].values():
        lines.append(f"| {p['bookkeeping']} | {p['gpus']} | {p['interval']} | {p['stall_s']:.4f} | "
                     f"{p['durable_s']:.2f} | {p['overhead'] * 100:.3f} % | {p['per_gpu_gb']:.2f} | "
                     f"{p['per_node_gb']:.1f} | {p['d2h_s']:.3f} | {p['flush_s']:.2f} | {p['iteration_s']:.2f} |")
    paper = m["paper_70b_80gpu_gbps"]
    iteration = LLAMA2_70B["forward_s"] + LLAMA2_70B["backward_s"] + LLAMA2_70B["update_s"]
    lines += ["", f"The paper, 70B on 80 GPUs, every iteration, as seconds training is blocked: DataStates "
              f"{LLAMA2_70B['checkpoint_gb'] / paper['datastates']:.2f} s "
              f"({LLAMA2_70B['checkpoint_gb'] / paper['datastates'] / iteration * 100:.1f} % of an iteration), "
              f"DeepSpeed {LLAMA2_70B['checkpoint_gb'] / paper['deepspeed']:.1f} s (its \"checkpoint throughput\" of "
              f"{paper['datastates']:.0f} and {paper['deepspeed']:.0f} GB/s is the checkpoint's size over these "
              "seconds)."]
    return "\n".join(lines)
