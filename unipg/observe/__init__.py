"""What happened in a run: the metrics stream and progress display (``metrics``, ``records``), plots, multi-seed
summaries, result tables (``report``), and the doctor with its findings, checks and trend helpers."""
