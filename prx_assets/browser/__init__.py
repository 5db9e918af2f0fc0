"""The corpus browser (`prx-assets browse`): a web app over the pipeline's Lance tables."""
