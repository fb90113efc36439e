"""What operators see: the metrics registry and the tiers' metric definitions,
tracing, time series, the trace view, the process logs."""
