"""Why a peak is what it is: attribution events replayed into a typed Explanation (replay, blocks), what
grew against a baseline (growth), and the explanation in words (text). The page is report/html.py."""
