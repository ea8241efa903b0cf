"""What each lecture measures and draws, one module per topic (`course_lib.measure.<topic>`),
apart from the topic's own code in `course_lib.<topic>`."""
