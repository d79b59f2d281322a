"""The pipeline's rules (nightly planning, champion/challenger, gates, data quality, routing, the run report,
the model registry) and the task bodies that apply them through the hooks. DAG files call these; nothing
here is imported by ``utils``, ``config``, the hooks or the triggers.
"""
