"""meshfit: plan, verify and train models that do not fit in one device's memory."""

__version__ = "0.1.0"
