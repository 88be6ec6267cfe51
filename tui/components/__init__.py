"""The dashboard's panels and modal screens, one per module."""
