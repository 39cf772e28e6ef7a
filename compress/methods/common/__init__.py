"""What the methods share, itself no method: GPTQ's solver, running Hessians, the held-out RTN fallback, guided
token weights, self-generated data and the MoE expert step. Nothing here imports a method."""
