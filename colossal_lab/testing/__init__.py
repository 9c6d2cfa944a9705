"""Checks shared by the tests and the chapters: the correctness rule and the gradient
checks of the parallel switches against one process."""
