"""What each lecture measures and draws, one module per topic (`course_lib.measure.<topic>`),
apart from the topic's own code in `course_lib.<topic>`; and the checks of the lecture's
exercises, named after what each asks (`check_sgd_budget(...)`), which compute the expected
value off the page, so that a cell shows no expression a student could copy."""
