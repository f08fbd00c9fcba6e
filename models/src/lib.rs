//! Model ports on candle-fp4.
