"""One rank's run: the training loop, its monitor, evaluation, forgetting, divergence and the LR schedule."""
