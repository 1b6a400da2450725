"""The product commands beside the stages: `lmgeo analyse`, `bench`, `tune`, `check-model`, `families`, `rehearse`."""
