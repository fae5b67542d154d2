"""Real cards' memory snapshots: a reader that runs no code (`read`) and a replay of a card's figures (`replay`)."""
