"""The pair against its source through quantkit's own streaming forward: measurement, metrics (one
KL), gates, and rendering (markdown, plot, model cards).
"""
