"""Layouts and plans as the edges name them (light: no numpy, no checkpoint reading)."""

from ..plan.declared import DeclaredLayout, LayoutGroup
from ..plan.layout import Layout, LayoutFields
from ..plan.planner import RankPlan
from ..plan.slices import TensorSlice

__all__ = ["DeclaredLayout", "Layout", "LayoutFields", "LayoutGroup", "RankPlan", "TensorSlice"]
