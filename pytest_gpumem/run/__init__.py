"""One pytest run: its state, each test judged against budget and baselines, the hand-over to xdist."""
