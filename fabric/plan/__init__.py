"""Logical plans: frozen nodes, their text form (explain and test oracle)."""
