"""Scripts outside the installed package: the GPU node's check and the records of preset runs."""
