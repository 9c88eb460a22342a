"""Numerics: the precision recipe and the GEMMs it selects."""
from megafp8.precision.recipe import PrecisionRecipe

__all__ = ["PrecisionRecipe"]
