"""Reward policy: several reward sources per sample, late arrivals, deadlines, fallbacks and aggregation."""
