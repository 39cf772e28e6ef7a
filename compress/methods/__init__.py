"""The quantization methods, one file each (rtn, nf4, gptq, awq, qat, embed_head, head_gptq): pure maths, then the
adapter behind the one signature ``quantize(model, cfg, run)`` (compress/pipeline.py). No method imports another;
what several share (GPTQ's solver, the RTN fallback, Hessians, token weights, self-generated data, MoE experts)
lives in common/, which imports no method."""
