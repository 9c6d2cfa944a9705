"""The book's helpers, kept apart from the library's core.

Showing source and tables in notebooks, figures, cross-links, references and the
results-integrity check."""
