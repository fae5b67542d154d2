"""The gpumem fixture object and what it measures beyond one call: phases, fit, advise, OOM and leaks."""
