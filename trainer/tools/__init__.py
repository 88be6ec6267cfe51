"""Helper commands beside training: the demo assets and make-retention-set."""
