"""`gpumem.advise`: the user's step measured as it is and with each memory-saving strategy (`run`), the
strategies themselves (`strategies`, one of them the chunked cross-entropy of `chunked`) and their base class
and what they work on (`strategy`). The advice it returns is plain data (`results/advice.py`); its sentences
are in `report/advice_text.py`."""
