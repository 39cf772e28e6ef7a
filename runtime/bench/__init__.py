"""Speed measurement, apart from the engine it measures: timing.py is the one measurement core (TTFT, TPOT,
tokens per second, medians) that ``compress bench`` (scenarios.py), ``compress report`` (eval/tradeoff/speed.py)
and scripts/bench/cpu_speed.py all call; workload.py makes the synthetic requests."""
