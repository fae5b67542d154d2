"""The memory of every test across commits, read from the git history of the committed baseline file.

``git.py`` reads the file as each commit of HEAD's first-parent line that changed it holds it (one
``git log --first-parent``, one ``git cat-file --batch``; renames followed, copies not) and the commit a
work tree is at (for ``--gpumem-json``), ``series.py`` turns the versions into per-test,
per-phase series with their steps and judges growth, ``reports.py`` joins ``--gpumem-json`` reports at
their commits, ``table.py`` shows the series (terminal table, Markdown, JSON), ``page.py`` draws them
(``--html``), ``command.py`` is the ``history`` subcommand. No pytest, no torch.
"""
