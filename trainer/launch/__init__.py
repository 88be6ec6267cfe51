"""Starting a run: the osft-train command line, the launcher and torchrun's agent, the start-up plan, the Python API."""
