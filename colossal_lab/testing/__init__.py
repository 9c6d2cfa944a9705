"""Checks shared by the tests and the chapters.

The correctness rule (`correctness`), the gradient checks of the parallel switches
against one process (`gradient_checks`) and the pipeline's (`pipeline_check`).
"""
