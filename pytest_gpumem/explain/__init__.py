"""Why a peak is what it is: the allocations alive at it (replay) and their rendering as text and HTML."""
