"""Renderers: they display computed results and never compute attention themselves."""
