"""The memory of every test across commits, read from the git history of the committed baseline file.

``git.py`` reads every committed version of the file (one ``git log``, one ``git cat-file --batch``),
``series.py`` turns the versions into per-test, per-phase series with their steps and judges growth,
``table.py`` shows them (terminal table, Markdown, JSON), ``command.py`` is the ``history`` subcommand.
No pytest, no torch.
"""
