"""What is shown: display views and maps, terminal cells, colour scales."""
