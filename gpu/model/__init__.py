"""Weights and the decoder's math, as the layer spec says; a new family's operation goes here."""
