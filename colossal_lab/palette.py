"""The book's colours, in one place, so a figure drawn anywhere in the library matches."""

BLUE, ORANGE, GREY = "#3b6ea8", "#e08a2c", "#9a9a9a"
