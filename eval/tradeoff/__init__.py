"""`compress report`: every variant of one model measured on the same settings (size, perplexity, KL to
the fp model, task accuracy, speed), cached per variant, then one table, plots and recommendations."""
