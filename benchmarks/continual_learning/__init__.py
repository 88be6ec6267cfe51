"""Parts of ``benchmarks/continual.py``: task data (trivia, WordNet), methods, measurements, report."""
