"""Assemble an engine from an EngineConfig: resolve device and dtype, load the model and its
tokenizer, size the KV cache, and wire scheduler, runner and engine together."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tandem.config import EngineConfig, ModelConfig, SchedulerConfig
from tandem.core.engine import Engine
from tandem.core.outputs import StepStats
from tandem.core.sampling_params import SamplingParams
from tandem.core.step import KVLayout, ScheduledChunk, SchedulerOutput
from tandem.core.step_time import Observation, StepCost, features, fit
from tandem.kernels.cpu_features import available_cores, cpu_info
from tandem.models.auto_mode import AutoChoice, choose_quantization
from tandem.models.base import CausalLM
from tandem.models.decode_layers import DecodeLayers
from tandem.models.quantizers import QUANTIZERS, finish
from tandem.models.registry import instantiate
from tandem.model_files import model_files
from tandem.models.spec import ModelSpec
from tandem.ops.dispatch import OpTable, select_ops
from tandem.ops.modes import describe_paths
from tandem.paths import default_cache_dir
from tandem.runner.grammar import GrammarCompiler
from tandem.runner.mode_timing import StepTimer
from tandem.runner.runner import ModelRunner, kv_bytes_per_block
from tandem.tokenizer import Tokenizer
from tandem.utilization import ModelCost
from tandem.weights.loader import load_weights

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192  # keeps rope tables and the default KV budget modest on a CPU


def resolve_device(name: str) -> torch.device:
    """``name`` as validated by ``ModelConfig.validate``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but this machine has no usable CUDA device")
    return torch.device(name)


def cpu_supports_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``name`` as validated by ``ModelConfig.validate``."""
    if name == "auto":
        if device.type == "cuda" or cpu_supports_bf16():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    spec: ModelSpec
    name: str
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    quantization: str = "none"
    auto: AutoChoice | None = None
    """How ``--quantization auto`` chose, when it did."""
    step_priors: dict[tuple[int, int, int], StepCost] = field(default_factory=dict)
    """``step_prior`` per KV layout (blocks, block size) and full batch (``max_num_seqs``), measured
    once: engines built over this model (one per `tandem compare` configuration) start from the same
    estimate."""
    grammar: GrammarCompiler | None = None
    """Structured outputs' compiler: its compiled grammars serve every engine over this model."""

    @property
    def w8a8_kernels(self):
        """The native kernels the w8a8 matmuls run on, when that is the weight format (for the
        compute peak utilization is measured against)."""
        return self.model.ops.int8_kernels if self.quantization == "w8a8" else None

    @property
    def w8a8_bf16_prompts(self) -> bool:
        """w8a8 with its prompt rows on bf16 matmuls (``OpTable.w8a8_prompt_bf16_tokens``)."""
        return self.quantization == "w8a8" and self.model.ops.w8a8_prompt_bf16_tokens is not None

    def paths(self) -> dict[str, object]:
        """Which paths run: the CPU and its features, each op's implementation and why, the
        weight format and how it was chosen (start-up log, /config, /metrics, result files)."""
        ops = self.model.ops
        impls, reasons = ops.describe(), {op: c.reason for op, c in ops.choices.items()}
        if self.model.decode_layers is None and impls.get("decode_layers", "per-op") != "per-op":
            # the table allows the fused decode layers; this model's weights or layers do not
            impls["decode_layers"] = "per-op"
            reasons["decode_layers"] = (DecodeLayers.why_not(self.model)
                                        or f"the fused decode layers take w8a8 weights, not {self.quantization}")
        return {
            "device": self.device.type,
            "cpu": cpu_info().describe() if self.device.type == "cpu" else None,
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "quantization_reason": self.auto.reason if self.auto else "asked for",
            "ops": impls,
            "op_reasons": reasons,
        }

    def paths_line(self) -> str:
        """``paths()`` in one line for the start-up log."""
        return describe_paths(self.paths())

    @property
    def weight_bytes(self) -> float:
        """Bytes per matmul weight as stored (``Quantizer.bytes_per_weight``; a fraction for int4)."""
        if self.quantization == "none":
            return self.dtype.itemsize
        return QUANTIZERS[self.quantization].bytes_per_weight

    def cost(self) -> ModelCost:
        """FLOPs and bytes per step of this model as loaded (dtype and weight format)."""
        return ModelCost.from_spec(self.spec, self.dtype.itemsize, self.weight_bytes)


def load_model(config: ModelConfig, ops: OpTable | None = None) -> LoadedModel:
    """Load the model ``config`` names; ``ops`` overrides the op choice (else ``select_ops``)."""
    from tandem.weights.safetensors_dir import iter_safetensors

    config.validate()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    cache_dir = Path(config.cache_dir) if config.cache_dir else None
    path, weights_dir, spec, tokenizer = model_files(config)
    max_len = config.max_model_len or min(spec.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_len > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_len} exceeds the model's {spec.max_position_embeddings} positions"
        )
    quantization, auto, probe = config.quantization, None, None
    if quantization == "auto":
        probe = ops or select_ops(device, torch.float32, config.kernels)
        # accuracy was measured on the default model's file: the same GGUF file, by name, is eligible
        model_file = path.name if path.suffix == ".gguf" else None
        native = probe if dtype == torch.float32 else select_ops(device, dtype, config.kernels)
        timer = StepTimer(spec, dtype, probe, native)
        auto = choose_quantization(spec, device, dtype, probe, model_file, cache_dir or default_cache_dir(), timer)
        quantization = auto.quantization
        log.info("quantization auto -> %s: %s", quantization, auto.reason)
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"quantization: {quantization!r} runs on the CPU only, not on {device.type}")
    if quantization != "none" and config.dtype == "auto":
        dtype = torch.float32  # the int8 kernels take float32 activations
    if ops is None:  # the float32 table auto timed with serves a float32 model as it is
        ops = probe if probe is not None and dtype == torch.float32 else select_ops(device, dtype, config.kernels)
    model = instantiate(spec, max_len, device, dtype, ops)
    load_weights(model, iter_safetensors(weights_dir))
    finish(model, quantization)
    return LoadedModel(
        model, tokenizer, spec, config.model or "gemma-3-270m", max_len, device, dtype, quantization, auto
    )


def set_threads(threads: int | None) -> None:
    torch.set_num_threads(threads if threads is not None else available_cores())


def engine_for(
    config: EngineConfig,
    loaded: LoadedModel,
    clock: Callable[[], float] = time.monotonic,
    on_step: Callable[[StepStats], None] | None = None,
) -> Engine:
    """A fresh engine (KV cache, scheduler, sampler) over an already loaded model."""
    config.validate()
    per_block = kv_bytes_per_block(loaded.model, config.cache.block_size, loaded.dtype)
    num_blocks = config.cache.num_kv_blocks or int(config.cache.kv_cache_memory_gib * (1 << 30) // per_block)
    if num_blocks < 1:
        raise ValueError("kv_cache_memory_gib: too small for a single KV-cache block")
    layout = KVLayout(num_blocks, config.cache.block_size)
    if loaded.grammar is None:
        loaded.grammar = GrammarCompiler(loaded.tokenizer, loaded.spec.vocab_size, config.model.grammar_cache_size)
    runner = ModelRunner(loaded.model, layout, loaded.device, loaded.dtype, config.model.seed,
                         loaded.tokenizer.eos_token_ids, loaded.grammar)
    key = (layout.num_blocks, layout.block_size, config.scheduler.max_num_seqs)
    if key not in loaded.step_priors:
        loaded.step_priors[key] = step_prior(runner, layout, loaded.max_model_len,
                                             max_num_seqs=config.scheduler.max_num_seqs)
        log.info("step-time prior: %s", loaded.step_priors[key])
    prior = loaded.step_priors[key]
    return Engine(
        config.scheduler,
        runner,
        loaded.tokenizer,
        kv_layout=layout,
        max_model_len=loaded.max_model_len,
        clock=clock,
        on_step=on_step,
        step_prior=prior,
        # a fresh engine's cache starts empty, so this only keeps its block names apart from any
        # other model's (block hashes are what a prefix-aware router would compare)
        cache_namespace=f"{loaded.name}|{loaded.dtype}|{loaded.quantization}",
    )


WARMUP_SECONDS = 0.8
"""Start-up time the step-time prior may take (the shapes below stop early beyond it)."""


def step_prior(runner: ModelRunner, layout: KVLayout, max_model_len: int,
               clock: Callable[[], float] = time.perf_counter,
               max_num_seqs: int = SchedulerConfig.max_num_seqs) -> StepCost:
    """The step-time model's start-up estimate: a few timed forward passes of different shapes
    (one decode, a short and a longer prompt chunk, a full batch of ``max_num_seqs`` decodes at a
    prompt's context, a batch of decodes at a long context, a chunk behind a long context), fitted
    as the online model fits. The full batch is measured, not extrapolated: it is what the default
    ITL target is a multiple of (``tandem.core.target_budget``), and a fit of the first steps of a
    load, which hold a few decodes beside prompt chunks, can put a full batch anywhere from a
    fraction to several times its real cost. The short chunk prices what a step
    pays once for carrying prompt work (``per_prompt_step``): without it, the first steps that mix
    a prompt chunk into running decodes are predicted far too fast. The short chunk is the start of
    a longer prompt, as the small chunks an ITL target cuts are: where the runner sends a request's
    prompt rows down another road by the prompt's length (w8a8's bf16 road, in whole tiles of rows),
    that road's price is the one to learn. The first four shapes are timed on every machine, however
    slow; the long-context ones only while ``WARMUP_SECONDS`` last. They run before any request, on
    the fresh KV cache: what they write there is overwritten before any request reads it."""
    positions = min(layout.num_slots, max_model_len)
    far = min(1024, positions - 128)
    chunk = max(1, min(128, positions - 1))
    short = max(2, min(16, chunk // 4))
    mid = max(1, min(256, positions - 1))  # a prompt's context, where the full batch decodes
    shapes = [[(0, 1, 1)], [(0, short, chunk)], [(0, chunk, chunk)]]  # (start, tokens, prompt length)
    if max_num_seqs > 1:
        shapes.append([(mid, 1, mid + 1)] * max_num_seqs)
    essential = len(shapes)  # timed on every machine; the long-context shapes only while time is left
    if far > 0:
        shapes += [[(far, 1, far + 1)] * 8, [(far, 64, far + 64)], [(far, 1, far + 1)]]
    table = tuple(range(min(layout.num_blocks, layout.blocks_for(max(far + 64, chunk, mid + 1)))))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    observations: list[Observation] = []
    deadline = clock() + WARMUP_SECONDS
    for i, shape in enumerate(shapes):
        out = SchedulerOutput(step_id=0, chunks=tuple(
            ScheduledChunk(f"warmup-{i}-{j}", start, (1,) * n, table, params, start + n >= prompt, n == 1,
                           prompt)
            for j, (start, n, prompt) in enumerate(shape)))
        spans = [(start, n) for start, n, _ in shape]
        best = float("inf")
        for _ in range(3):  # the first run of a shape pays its one-time costs; keep the best of the rest
            t = clock()
            runner.execute(out)
            best = min(best, clock() - t)
        observations.append(Observation(features(spans), best))
        if i + 1 >= essential and clock() > deadline:
            break
    return StepCost(*fit(observations, StepCost().vector(), prior_weight=0.5))


def build_engine(
    config: EngineConfig,
    clock: Callable[[], float] = time.monotonic,
    on_step: Callable[[StepStats], None] | None = None,
) -> tuple[Engine, LoadedModel]:
    config.validate()
    set_threads(config.model.threads)
    loaded = load_model(config.model)
    return engine_for(config, loaded, clock, on_step), loaded
