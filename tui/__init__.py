"""``osft-tui``: the Textual job controller for osft runs (launch, watch, checkpoint, resume).

It reads only the run directory and acts on a run only through signals and ``control/`` files
(docs/architecture.md sections 1, 3, 6 and 9), so it also watches runs it did not start.
"""
