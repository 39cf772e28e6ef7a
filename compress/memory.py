"""How much memory a quantization run needs, estimated from the config alone, before any weight is read.

The figures are upper estimates of the resident set: the process itself (torch, transformers), the
weights held at once (one decoder block when streaming, the whole model otherwise; training adds
gradients, Adam's two moments and a teacher copy), the calibration activations (inputs and outputs
of a block, fp32) and the method's own statistics (GPTQ Hessians, AWQ's sampled rows), and what the tables outside
the blocks cost (embedding and untied head: the source slabs read for them, their quantized codes, the tokenizer
of their vocabulary), which grows with the vocabulary, not the depth.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from compress.format.host import available_bytes, gib

# python + torch + transformers + tokenizer and what a layer pass leaves resident: 0.7-0.9 GB measured before the
# fallback's held-out forwards; SmolLM2 awq4 streamed then peaked at 1,855 MiB where 900 MiB here estimated 1,810
BASE_BYTES = 1 << 30


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _model_numel(model: nn.Module) -> int:
    """The model's parameters, a tied head counted once: a meta skeleton (compress/stream.py) does not share the
    table's tensor between the embedding and the head, so its parameters count it twice (0.87 GiB of fp32 on a
    151,936 x 1,536 table)."""
    from compress.stream import tied

    n = _numel(model)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if tied(model) and head is not None and embed is not None and head.weight is not embed.weight:
        n -= head.weight.numel()
    return n


@dataclass(frozen=True)
class MemoryPlan:
    weights: int  # fp32 weights resident at once
    activations: int
    statistics: int
    training: int = 0  # gradients, optimizer state and one step's graph, for QAT / uptraining
    gradients: int = 0  # guided GPTQ's backward pass over one sequence: freed before the blocks' activations exist
    halved: int = 0  # what the pass saves of ``weights``: bfloat16-exact linear weights held as bfloat16 meanwhile
    teacher: int = 0  # QAT's fp teacher, held from before the PTQ start to the end of training
    phased: bool = False  # QAT: the PTQ start's activations, statistics and gradients are freed before training
    outer: int = 0  # the embedding and head's reads, codes and temporaries, and the tokenizer (:func:`outer_bytes`)

    @property
    def ptq(self) -> int:
        """The calibration's own peak: the gradient pass, then the blocks' activations and statistics."""
        return max(self.gradients - self.halved, self.activations + self.statistics)

    @property
    def peak(self) -> int:
        ptq = self.ptq
        work = max(ptq, self.training) if self.phased else ptq + self.training
        return BASE_BYTES + self.weights + self.teacher + work + self.outer

    def describe(self) -> str:
        grads = f"gradient pass {gib(self.gradients)}" + (f" less {gib(self.halved)} of weights in bfloat16"
                                                         if self.halved else "")
        parts = [f"weights {gib(self.weights)}", f"activations {gib(self.activations)}",
                 f"statistics {gib(self.statistics)}"] + ([grads] if self.gradients else []) \
            + ([f"{'then ' if self.phased else ''}training {gib(self.training)}"] if self.training else []) \
            + ([f"teacher {gib(self.teacher)}"] if self.teacher else []) \
            + ([f"embedding and head {gib(self.outer)}"] if self.outer else [])
        return f"about {gib(self.peak)} ({', '.join(parts)}, process {gib(BASE_BYTES)})"


def plan(model: nn.Module, cfg, streamed: bool, offload: bool = False, bf16_blocks: bool = False) -> MemoryPlan:
    """The estimate for quantizing ``model`` (a meta skeleton is enough) with ``cfg`` (``offload``: the calibration
    activations on disk, one batch in memory at a time; ``bf16_blocks``: the source stores the decoder blocks' weights
    in bfloat16, which guided GPTQ's gradient pass holds as such)."""
    from compress.calibrate import decoder_layers
    from compress.methods.common.guided import quantized_linears

    layers = decoder_layers(model)
    block = max(_numel(b) for b in layers) * 4
    linears = [m for m in layers[0].modules() if isinstance(m, nn.Linear)]
    widest = max((m.in_features for m in linears), default=0)
    calib = cfg.needs_calibration
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = text.hidden_size
    batch = min(cfg.batch_size, cfg.nsamples) if calib else 0
    tokens = (batch if offload else cfg.nsamples) * cfg.seqlen if calib else 0
    if cfg.method == "qat":  # QAT trains on token batches; only its PTQ start holds activations, of its own tokens
        from compress.methods.qat import PTQ_INIT_TOKENS
        tokens = 0 if cfg.qat.init == "rtn" else min(tokens, PTQ_INIT_TOKENS)
    activations = 3 * tokens * hidden * 4  # a block's inputs, its outputs, and one batch's intermediates
    statistics = 0
    if cfg.gptq_rounding:
        # one block's Hessians (one per linear: shared ones counted as many), then GPTQ's working copy of the widest
        # and the next factor made from it (compress/methods/gptq.py); coordinate descent keeps a third, the damped
        # Hessian, and four weight-sized fp32 tensors: its target, result, E H and a gathered scale or zero
        # (methods/common/coordinate_descent.py)
        cd = cfg.gptq.cd_passes > 0
        largest = max((m.in_features * m.out_features for m in linears), default=0)
        statistics = (sum(m.in_features ** 2 for m in linears) * 4 + (2 + cfg.gptq.refit + cd) * widest ** 2 * 4
                      + cd * 4 * largest * 4)
        if cfg.gptq.guided:  # the gradient pass's token weights: one float per token and linear, kept to the end
            statistics += len(linears) * len(layers) * cfg.nsamples * cfg.seqlen * 4
        # a batch's intermediates at the MLP's width, where they outgrow a third set of hidden states
        activations = max(activations, 2 * tokens * hidden * 4 + batch * cfg.seqlen * (6 * hidden + 2 * widest) * 4)
    if cfg.method == "awq" or cfg.method == "qat" and cfg.qat.init == "awq":
        statistics += len(linears) * cfg.awq.search_tokens * widest * 4
    outer = outer_bytes(model, cfg, streamed)
    if streamed:  # one fp32 block, its stored copy while loading, the packed result
        return MemoryPlan(2 * block, activations, statistics, outer=outer)
    whole = _model_numel(model) * 4
    training, teacher = 0, 0
    if cfg.method == "qat" or cfg.uptrain_steps or cfg.kv_fit_steps:
        # gradients + Adam's two moments, and one step's graph; the fp teacher
        training, teacher = 3 * whole + _train_graph(cfg, len(layers), hidden, widest, text.vocab_size), whole
    gradients = halved = 0
    if cfg.gptq_rounding and cfg.gptq.guided:  # methods/common/guided.py: one sequence's graph, the blocks checkpointed
        gradients = _gradient_graph(cfg.seqlen, len(layers), hidden, widest, block, text.vocab_size)
        if bf16_blocks:  # guided.bfloat16_weights: the quantized linears' fp32 weights held as bfloat16 for the pass
            halved = 2 * sum(m.weight.numel() for m in quantized_linears(model, cfg.ignore).values())
    phased = cfg.method == "qat" and cfg.qat.init != "rtn"  # compress/methods/qat.py: init_ptq returns, then training
    return MemoryPlan(whole + block, activations, statistics, training, gradients, halved, teacher, phased, outer)


def _gradient_graph(seqlen: int, n_layers: int, hidden: int, widest: int, block: int, vocab: int) -> int:
    """What guided GPTQ's backward over one sequence holds (compress/methods/common/guided.py): each block's fp32 input
    and its gradient (checkpointed), one block's recomputed activations (~50 values of its widths per token, the old
    per-layer figure) with its bfloat16 weights, the head's bfloat16 weight, and per vocabulary entry and position the
    bfloat16 logits, their float32 copy, the log-softmax kept for the backward, its gradient and that gradient's
    bfloat16 copy (16 bytes; 20 with slack). The Qwen2.5-1.5B shape (28 blocks, 151,936 entries, 512 positions) peaked
    2.5 GiB over the loaded model's resident set (VmHWM 10.40 GiB); this counts 2.62 GiB."""
    return (2 * n_layers * seqlen * hidden * 4 + 5 * seqlen * (10 * hidden + 4 * widest) * 4 + block // 2
            + vocab * hidden * 2 + seqlen * vocab * 20)


TOKENIZER_BYTES_PER_TOKEN = 1024  # a folder's tokenizer: ~150 B per token measured (SmolLM2's 49,152); GGUF's: ~3 KB


def outer_bytes(model: nn.Module, cfg, streamed: bool) -> int:
    """Beyond the weights counted elsewhere, what the embedding and an untied head cost while quantizing: streamed, a
    source slab as read, its fp32 copy and the previous fp32 slab still referenced (compress/format/shards.py
    SLAB_BYTES, 16-bit sources); in memory, the tables' 16-bit source pages while loading and their 16-bit copies while
    saving; both, the packed codes of quantized tables with one chunk's temporaries (compress/methods/embed_head.py),
    and the tokenizer of the vocabulary."""
    from compress.format.shards import SLAB_BYTES
    from compress.methods.embed_head import CHUNK_VALUES, head_scheme, plan_outer
    from compress.methods.head_gptq import HEAD_SLAB_ROWS

    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab, hidden, tied = text.vocab_size, text.hidden_size, bool(getattr(text, "tie_word_embeddings", False))
    tables = (1 if tied else 2) * vocab * hidden
    plan = plan_outer(cfg, tied)
    schemes = [s for s in (plan.embed, plan.head) if s is not None]
    codes = sum(vocab * hidden * s.bits // 8 + vocab * s.n_groups(hidden) * 3 for s in schemes)
    work = CHUNK_VALUES * 48 if schemes else 0  # fp32 values, grouped copies, int64 codes while packing
    if head_scheme(plan, cfg) is not None:  # compress/methods/head_gptq.py: streamed, the head read whole (at most
        # fp32); its uint8 codes, as slabs and joined; one slab's fp32 copies, candidates and held-out products
        work += ((4 if streamed else 0) + 2) * vocab * hidden + 8 * 4 * HEAD_SLAB_ROWS * hidden
    reads = 5 * SLAB_BYTES if streamed else 2 * tables * 2
    return reads + codes + work + vocab * TOKENIZER_BYTES_PER_TOKEN


def _train_graph(cfg, n_layers: int, hidden: int, widest: int, vocab: int) -> int:
    """What a training step's backward keeps (compress/train.py): per token, about 12 values of the block's widths
    in each layer, at the autocast dtype, and ~24 bytes per vocabulary entry for both models' logits, the
    log-softmaxes and their gradient (fitted to SmolLM2-135M: 2.6 GiB at 4 x 256 tokens under bfloat16)."""
    per_value = 2 if cfg.train_dtype == "bfloat16" else 4
    return cfg.batch_size * cfg.seqlen * (n_layers * 12 * (hidden + widest) * per_value + 24 * vocab)


def fits(p: MemoryPlan, max_memory: int | None) -> bool:
    limit = max_memory if max_memory is not None else available_bytes()
    return limit is None or p.peak <= limit


def plan_offload(model: nn.Module, cfg, streamed: bool, max_memory: int | None,
                 offload: bool | None, bf16_blocks: bool = False) -> tuple[MemoryPlan, bool]:
    """The estimate, and whether the calibration activations go to disk: as ``offload`` says, or (None) exactly
    when the run fits only with them there."""
    if not cfg.needs_calibration or cfg.method == "qat":  # QAT trains on token batches, not stored activations
        return plan(model, cfg, streamed, bf16_blocks=bf16_blocks), False
    held, on_disk = (plan(model, cfg, streamed, offload=o, bf16_blocks=bf16_blocks) for o in (False, True))
    if offload is None:
        offload = not fits(held, max_memory) and fits(on_disk, max_memory)
    return (on_disk if offload else held), offload


def check(p: MemoryPlan, max_memory: int | None, what: str) -> None:
    """Refuse before any work when the estimate exceeds ``--max-memory`` or what the machine has free."""
    avail = available_bytes()
    if max_memory is not None and p.peak > max_memory:
        raise MemoryError(f"{what} needs {p.describe()}, more than --max-memory {gib(max_memory)}; "
                          "raise --max-memory, or lower --nsamples/--seqlen")
    if max_memory is None and avail is not None and p.peak > avail:
        raise MemoryError(f"{what} needs {p.describe()}, and this machine has {gib(avail)} free; "
                          "free memory, lower --nsamples/--seqlen, --offload-activations, or use a streaming "
                          "method (rtn, gptq, awq)")
