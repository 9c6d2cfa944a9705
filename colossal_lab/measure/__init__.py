"""Measuring: timing, MFU, the hardware's ceilings, profiles and the results files.

Timing, FLOP accounting and MFU, the hardware's peaks and ceilings, telemetry, profiles,
comparisons and the results files with their provenance."""
