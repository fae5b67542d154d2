"""`gpumem.advise`: the user's step measured as it is and with each memory-saving strategy (`run`), the
strategies themselves (`kinds`) and what they work on (`strategies`). The advice it returns is plain data
(`results/advice.py`); its sentences are in `report/advice.py`."""
