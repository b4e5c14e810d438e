"""dit-accel: profile and accelerate video diffusion-transformer inference."""
__version__ = "0.1.0"
