"""Run an exported ONNX folder like a torch causal LM: ``model(input_ids, attention_mask).logits`` and greedy
``generate`` with the key/value cache, on ONNX Runtime (CPU unless other providers are given)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from compress.exporters.onnx_fp import MODEL_FILE

log = logging.getLogger(__name__)
_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


@dataclass
class OnnxOutput:
    logits: Tensor  # float32 [batch, sequence, vocab]


def is_onnx_folder(path: str | Path) -> bool:
    return (Path(path) / MODEL_FILE).is_file()


def position_ids(mask: np.ndarray, seq: int) -> np.ndarray:
    """Positions counted over real tokens (left padding gets position 1, as optimum does), last ``seq``."""
    pos = np.cumsum(mask, axis=1) - 1
    pos[mask == 0] = 1
    return pos[:, -seq:].astype(np.int64)


class OnnxCausalLM:
    """An ONNX decoder exported by ``compress export --format onnx|onnx-int4``."""

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None):
        import onnxruntime as ort

        self.path = Path(path)
        if not is_onnx_folder(self.path):
            raise FileNotFoundError(f"{self.path} has no {MODEL_FILE}: expected a folder written by compress export")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(self.path / MODEL_FILE), options,
                                            providers=providers or ["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = [n for n in inputs if n.startswith("past_key_values.")]
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        self.n_layers = len(self.past_names) // 2
        first = inputs["past_key_values.0.key"]
        self.kv_heads, self.head_dim = first.shape[1], first.shape[3]
        self.np_dtype = _NP[first.type]
        self.uses_position_ids = "position_ids" in inputs
        self.config, self.generation_config = self._configs()

    def _configs(self):
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(self.path) if (self.path / "config.json").is_file() else None
        gen = None
        if (self.path / "generation_config.json").is_file():
            gen = GenerationConfig.from_pretrained(self.path)
        elif config is not None:
            gen = GenerationConfig.from_model_config(config)
        return config, gen

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def eval(self) -> "OnnxCausalLM":
        return self

    def _empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), self.np_dtype) for _ in self.past_names]

    def step(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One forward: new tokens ``ids`` [B, S], ``mask`` [B, past + S] -> (logits, present)."""
        feed = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
        if self.uses_position_ids:
            feed["position_ids"] = position_ids(mask, ids.shape[1])
        feed.update(zip(self.past_names, past))
        logits, *present = self.session.run(["logits", *self.present_names], feed)
        return logits, present

    def __call__(self, input_ids: Tensor | np.ndarray, attention_mask: Tensor | np.ndarray | None = None,
                 **_: object) -> OnnxOutput:
        ids = np.asarray(input_ids.cpu() if isinstance(input_ids, Tensor) else input_ids)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(
            attention_mask.cpu() if isinstance(attention_mask, Tensor) else attention_mask)
        logits, _ = self.step(ids, mask, self._empty_past(ids.shape[0]))
        return OnnxOutput(torch.from_numpy(logits.astype(np.float32)))

    def generate(self, input_ids: Tensor, max_new_tokens: int = 64, attention_mask: Tensor | None = None,
                 eos_token_id: int | list[int] | None = None) -> Tensor:
        """Greedy decoding with the cache; rows that produced an EOS keep emitting it. Returns prompt + new."""
        ids = np.asarray(input_ids.cpu(), dtype=np.int64)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask.cpu(), dtype=np.int64)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        out, done = [ids], np.zeros(ids.shape[0], dtype=bool)
        past, step_ids = self._empty_past(ids.shape[0]), ids
        for _ in range(max_new_tokens):
            logits, past = self.step(step_ids, mask, past)
            nxt = logits[:, -1].argmax(-1)
            if eos:
                nxt = np.where(done, eos[0], nxt)  # finished rows repeat the first EOS, like HF's padding
                done |= np.isin(nxt, eos)
            step_ids = nxt[:, None].astype(np.int64)
            out.append(step_ids)
            mask = np.concatenate([mask, np.ones_like(step_ids)], axis=1)
            if eos and done.all():
                break
        return torch.from_numpy(np.concatenate(out, axis=1))


def load_causal_lm(spec: str):
    """(model, tokenizer) for an exported ONNX folder or anything compress.models.load_model takes."""
    if is_onnx_folder(spec):
        from transformers import AutoTokenizer

        return OnnxCausalLM(spec), AutoTokenizer.from_pretrained(spec)
    from compress.format.models import load_model

    model, tokenizer, _ = load_model(spec)
    return model, tokenizer


def greedy_generate(model, input_ids: Tensor, max_new_tokens: int, eos_token_id=None) -> Tensor:
    """Greedy tokens from a torch model or an OnnxCausalLM, prompt included; stops at the model's EOS
    (its generation config's) unless ``eos_token_id`` is given (``[]``: never stop early)."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(model, OnnxCausalLM):
        return model.generate(input_ids, max_new_tokens, eos_token_id=eos_token_id)
    return _torch_greedy(model, input_ids, max_new_tokens, eos_token_id)


@torch.no_grad()
def _torch_greedy(model, ids: Tensor, max_new_tokens: int, eos_token_id) -> Tensor:
    """The same loop as OnnxCausalLM.generate on a transformers model with its DynamicCache (no logits
    processors, so nothing but argmax decides a token)."""
    from transformers import DynamicCache

    from compress.format.models import cache_kwarg

    cache_kw = cache_kwarg(model)
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []), dtype=torch.long)
    cache, out, step = DynamicCache(), [ids], ids
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = model(input_ids=step, use_cache=True, **{cache_kw: cache}).logits
        nxt = logits[:, -1].argmax(-1)
        if len(eos):
            nxt = torch.where(done, eos[0], nxt)
            done |= torch.isin(nxt, eos)
        step = nxt[:, None]
        out.append(step)
        if len(eos) and bool(done.all()):
            break
    return torch.cat(out, dim=1)
